"""`models.objectives` moved to `models.training.objectives` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.training.objectives`."""

import sys

from models.training import objectives

sys.modules[__name__] = objectives
