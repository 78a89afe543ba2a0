"""`models.moe` moved to `models.layers.moe` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.layers.moe`."""

import sys

from models.layers import moe

sys.modules[__name__] = moe
