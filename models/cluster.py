"""`models.cluster` moved to `models.cli.cluster` (issue 42): this path is that module
itself, so that code written for it keeps working. The house imports
`models.cli.cluster`."""

import sys

from models.cli import cluster

sys.modules[__name__] = cluster
