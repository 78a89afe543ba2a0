"""`models.export` moved to `models.cli.export` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.cli.export`."""

import sys

from models.cli import export

if __name__ == "__main__":  # `python -m models.export` runs it as before
    sys.exit(export.main())
else:
    sys.modules[__name__] = export
