"""`models.shards` moved to `models.io.shards` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.io.shards`."""

import sys

from models.io import shards

sys.modules[__name__] = shards
