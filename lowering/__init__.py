"""lowering: turns namedmesh programs into SPMD programs on a device mesh (issue 4)."""
