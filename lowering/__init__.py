"""lowering: turns namedmesh programs into SPMD programs on a device mesh.

`lower(fn, Mesh({"rows": 2, "cols": 4}), Layout("batch:rows;d_ff:cols"))` returns a
callable running jit(shard_map(...)) over the mesh; see lowering/lower.py.
"""

from lowering import attention_rule as _attention_rule  # registers the fused kernel's rule
from lowering import scan as _scan_rule  # registers the rule of nm.scan
from lowering.layout import Layout, partition_spec
from lowering.lower import Lowered, Plan, lower
from lowering.mesh import Mesh
from lowering.search import auto_layout
