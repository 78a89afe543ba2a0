"""lowering: turns namedmesh programs into SPMD programs on a device mesh.

`lower(fn, Mesh({"rows": 2, "cols": 4}), Layout("batch:rows;d_ff:cols"))` returns a
callable running jit(shard_map(...)) over the mesh; see lowering/lower.py.
"""

from lowering.emit import PlanMismatch
from lowering.layout import Layout, partition_spec
from lowering.lower import Lowered, lower
from lowering.mesh import Mesh
from lowering.plan import Plan
from lowering.search import auto_layout
