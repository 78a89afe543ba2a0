"""`models.generate` moved to `models.cli.generate` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.cli.generate`."""

import sys

from models.cli import generate

if __name__ == "__main__":  # `python -m models.generate` runs it as before
    sys.exit(generate.main())
else:
    sys.modules[__name__] = generate
