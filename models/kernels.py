"""`models.kernels` moved to `models.layers.kernels` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.layers.kernels`."""

import sys

from models.layers import kernels

sys.modules[__name__] = kernels
