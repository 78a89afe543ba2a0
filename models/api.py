"""`models.api` moved to `models.inference.api` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.inference.api`."""

import sys

from models.inference import api

sys.modules[__name__] = api
