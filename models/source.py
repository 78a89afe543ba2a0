"""`models.source` moved to `models.io.source` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.io.source`."""

import sys

from models.io import source

sys.modules[__name__] = source
