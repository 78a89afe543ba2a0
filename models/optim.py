"""`models.optim` moved to `models.training.optim` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.optim`."""

import sys

from models.training import optim

sys.modules[__name__] = optim
