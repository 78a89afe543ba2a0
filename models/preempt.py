"""`models.preempt` moved to `models.training.preempt` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.preempt`."""

import sys

from models.training import preempt

sys.modules[__name__] = preempt
