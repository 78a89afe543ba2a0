"""`python -m namedmesh COMMAND ...`: the same as the `namedmesh` console command."""

import sys

from namedmesh.cli import main

sys.exit(main())
