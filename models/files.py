"""`models.files` moved to `models.io.files` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.io.files`."""

import sys

from models.io import files

sys.modules[__name__] = files
