"""`models.train` moved to `models.cli.train` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.cli.train`."""

import sys

from models.cli import train

if __name__ == "__main__":  # `python -m models.train` runs it as before
    sys.exit(train.main())
else:
    sys.modules[__name__] = train
