"""`models.chat` moved to `models.training.chat` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.chat`."""

import sys

from models.training import chat

sys.modules[__name__] = chat
