"""`models.watchdog` moved to `models.training.watchdog` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.training.watchdog`."""

import sys

from models.training import watchdog

sys.modules[__name__] = watchdog
