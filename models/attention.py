"""`models.attention` moved to `models.layers.blockwise` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.layers.blockwise`."""

import sys

from models.layers import blockwise

sys.modules[__name__] = blockwise
