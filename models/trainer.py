"""`models.trainer` moved to `models.training.trainer` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.trainer`."""

import sys

from models.training import trainer

sys.modules[__name__] = trainer
