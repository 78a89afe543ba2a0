"""`models.corpora` moved to `models.training.corpora` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.training.corpora`."""

import sys

from models.training import corpora

sys.modules[__name__] = corpora
