"""`models.continuations` moved to `models.inference.continuations` (issue 42): this path
is that module itself, so that code written for it keeps working. The house imports
`models.inference.continuations`."""

import sys

from models.inference import continuations

sys.modules[__name__] = continuations
