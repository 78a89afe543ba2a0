"""`models.launch` moved to `models.cli.launch` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.cli.launch`."""

import sys

from models.cli import launch

if __name__ == "__main__":  # `python -m models.launch` runs it as before
    sys.exit(launch.main())
else:
    sys.modules[__name__] = launch
