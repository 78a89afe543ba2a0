"""`models.run` moved to `models.training.run` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.training.run`."""

import sys

from models.training import run

sys.modules[__name__] = run
