"""`models.lora` moved to `models.layers.lora` (issue 42): this path is that module itself,
so that code written for it keeps working. The house imports `models.layers.lora`."""

import sys

from models.layers import lora

sys.modules[__name__] = lora
