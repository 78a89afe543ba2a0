"""The typed errors of namedmesh. Every message names the tensors, dims and sizes at fault."""


class NamedMeshError(Exception):
    """Base class of every error namedmesh raises for a user mistake."""


class ShapeError(NamedMeshError, ValueError):
    """Dims or sizes that do not fit an op: unknown dim, size mismatch, repeated name."""


class LayoutError(NamedMeshError, ValueError):
    """A layout that cannot be applied: unknown mesh axis, indivisible size, conflict."""


class PipelineError(LayoutError):
    """A layout that splits a scan's scanned dim (a pipeline) that the scan cannot run as
    one: layers or a batch that the stages or microbatches do not divide, a carry without
    the microbatched dim, a body that mixes examples along it."""


class MeshError(NamedMeshError, ValueError):
    """A mesh that cannot be built: too few devices, a size that is not positive."""


class ArgumentError(NamedMeshError, TypeError):
    """An argument of the wrong kind: a non-Tensor (a NumPy array, say) given to a lowered
    or traced function or where a Tensor is expected, an argument position that does not
    exist."""


class DtypeError(NamedMeshError, TypeError):
    """A dtype that cannot be computed as asked: a 64-bit value lowered while jax's
    `jax_enable_x64` is off (jax would compute it in 32 bits; see docs/lowering.md), an
    integer accumulation type for einsum, a compute dtype a model does not take."""


class NumPyDispatchError(ArgumentError):
    """A NumPy function or ufunc applied to a Tensor that has no named equivalent (the
    message names the function and the named op to use instead)."""


class TracedValueError(NamedMeshError, TypeError):
    """jax or NumPy applied to the `.data` of a traced Tensor: an op namedmesh cannot
    record. The message points to `nm.primitive`, the way to add one."""


class ParameterError(NamedMeshError, ValueError):
    """A parameter value an op does not take (an unknown policy or mode name)."""


def fmt_dims(dims, sizes=None) -> str:
    """`(batch: 4, d: 8)` when sizes are given, `(batch, d)` otherwise."""
    if sizes is None:
        return "(" + ", ".join(dims) + ")"
    return "(" + ", ".join(f"{d}: {s}" for d, s in zip(dims, sizes, strict=True)) + ")"
