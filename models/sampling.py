"""`models.sampling` moved to `models.inference.sampling` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.inference.sampling`."""

import sys

from models.inference import sampling

sys.modules[__name__] = sampling
