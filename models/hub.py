"""`models.hub` moved to `models.io.hub` (issue 42): this path is that module itself, so
that code written for it keeps working. The house imports `models.io.hub`."""

import sys

from models.io import hub

sys.modules[__name__] = hub
