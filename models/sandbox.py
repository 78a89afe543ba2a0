"""`models.sandbox` moved to `models.io.sandbox` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.io.sandbox`."""

import sys

from models.io import sandbox

sys.modules[__name__] = sandbox
