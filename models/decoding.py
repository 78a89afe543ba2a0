"""`models.decoding` moved to `models.inference.decoding` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.inference.decoding`."""

import sys

from models.inference import decoding

sys.modules[__name__] = decoding
