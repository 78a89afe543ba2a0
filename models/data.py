"""`models.data` moved to `models.training.data` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.data`."""

import sys

from models.training import data

sys.modules[__name__] = data
