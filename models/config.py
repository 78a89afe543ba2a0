"""`models.config` moved to `models.architecture` (issue 42), and its `configs` and `get`
to `models.catalog`: this path re-exports them, so that code written for it keeps
working. The house imports the new paths."""

from models.architecture import *  # noqa: F403
from models.catalog import configs, get  # noqa: F401
