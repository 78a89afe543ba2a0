"""The typed errors of namedmesh. Every message names the tensors, dims and sizes at fault."""


class NamedMeshError(Exception):
    """Base class of every error namedmesh raises for a user mistake."""


class ShapeError(NamedMeshError, ValueError):
    """Dims or sizes that do not fit an op: unknown dim, size mismatch, repeated name."""


class LayoutError(NamedMeshError, ValueError):
    """A layout that cannot be applied: unknown mesh axis, indivisible size, conflict."""


class MeshError(NamedMeshError, ValueError):
    """A mesh that cannot be built: too few devices, a size that is not positive."""


class DTypeError(NamedMeshError, ValueError):
    """A dtype or numeric precision an op cannot use (e.g. an integer accumulation type)."""


class ParameterError(NamedMeshError, ValueError):
    """A parameter value an op does not take (an unknown policy or mode name)."""


def fmt_dims(dims, sizes=None) -> str:
    """`(batch: 4, d: 8)` when sizes are given, `(batch, d)` otherwise."""
    if sizes is None:
        return "(" + ", ".join(dims) + ")"
    return "(" + ", ".join(f"{d}: {s}" for d, s in zip(dims, sizes, strict=True)) + ")"
