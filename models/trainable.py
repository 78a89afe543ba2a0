"""`models.trainable` moved to `models.training.trainable` (issue 42): this path is that
module itself, so that code written for it keeps working. The house imports
`models.training.trainable`."""

import sys

from models.training import trainable

sys.modules[__name__] = trainable
