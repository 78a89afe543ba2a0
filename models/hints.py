"""`models.hints` moved to `models.cli.hints` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.cli.hints`."""

import sys

from models.cli import hints

sys.modules[__name__] = hints
