"""NumPy functions on Tensors keep their dims (NEP 13 and 18: `__array_ufunc__`,
`__array_function__`).

`np.exp(t)`, `np.maximum(t, 0)`, `np.sum(t)`, `np.mean(t, axis="d")` run the named op,
so they trace and lower like `nm.exp(t)`. A function or ufunc method with no named
equivalent, an `axis` given as a position, or an argument the named op does not take
(`out=`, `keepdims=`) is a `NumPyDispatchError` naming the function and what to call
instead; never a bare ndarray without dims. Functions whose result has no dims to lose
(`np.allclose`, `np.shape`, ...) run on `np.asarray` of the Tensors, as `np.asarray(t)`
itself does.
"""

from __future__ import annotations

import numpy as np

from namedmesh.checks import names_not_positions
from namedmesh.errors import NumPyDispatchError

# NumPy's name of a ufunc -> namedmesh's, where they differ.
_UFUNC_ALIASES = {"absolute": "abs", "remainder": "mod", "true_divide": "divide", "rint": "round"}

# NumPy function -> (namedmesh name, takes dims through `axis`).
_FUNCTIONS = {
    "sum": ("sum", True),
    "mean": ("mean", True),
    "max": ("max", True),
    "amax": ("max", True),
    "min": ("min", True),
    "amin": ("min", True),
    "prod": ("prod", True),
    "all": ("all", True),
    "any": ("any", True),
    "var": ("var", True),
    "std": ("std", True),
    "argmax": ("argmax", True),
    "argmin": ("argmin", True),
    "cumsum": ("cumsum", True),
    "squeeze": ("squeeze", True),
    "where": ("where", False),
    "clip": ("clip", False),
    "round": ("round", False),
    "around": ("round", False),
    "transpose": ("transpose", False),
    "zeros_like": ("zeros_like", False),
    "ones_like": ("ones_like", False),
    "full_like": ("full_like", False),
}

# Functions whose result has no dims: they run on the Tensors' values.
_VALUE_LEVEL = {
    "allclose",
    "array_equal",
    "array_equiv",
    "shape",
    "ndim",
    "size",
    "result_type",
    "can_cast",
    "iscomplexobj",
    "isrealobj",
    "array_repr",
    "array_str",
    "array2string",
    "save",
    "savez",
    "savez_compressed",
    "copyto",
}


# The package's namespace (`namedmesh`), where each NumPy name's op is found: the
# package registers it when it has loaded (namedmesh/__init__.py), so that this module,
# below every op, imports none of them (nor the package, which would close a circle)
_NAMESPACE: list = []


def use_namespace(namespace) -> None:
    """Find the ops NumPy's names dispatch to in `namespace` (the `namedmesh` package)."""
    _NAMESPACE[:] = [namespace]


def _nm():
    return _NAMESPACE[0]


def apply_ufunc(ufunc, method: str, inputs, kwargs):
    """`ufunc.method(*inputs, **kwargs)` as the named op of the same name."""
    name = _UFUNC_ALIASES.get(ufunc.__name__, ufunc.__name__)
    fn = getattr(_nm(), name, None)
    what = f"np.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
    if fn is not None and method == "__call__" and kwargs:
        raise NumPyDispatchError(
            f"{what}(..., {', '.join(f'{k}=' for k in kwargs)}) on a Tensor: the named op "
            f"nm.{name} takes no {sorted(kwargs)}; call nm.{name}(...) without them"
        )
    if method != "__call__" or fn is None:
        hint = _HINTS.get(method, "write it with the named ops (nm.einsum, nm.where, ...)")
        raise NumPyDispatchError(
            f"{what} on a namedmesh.Tensor has no named equivalent: {hint}; or convert "
            "explicitly with np.asarray(t) (the dims are lost)"
        )
    return fn(*inputs)


_HINTS = {
    "reduce": "reduce by name, e.g. t.sum('d') for np.add.reduce",
    "accumulate": "use nm.cumsum(t, 'd') for np.add.accumulate",
    "outer": "broadcast by name: tensors with different dims combine as an outer product",
    "at": "Tensors are immutable; use nm.where or nm.pad",
}


# NumPy functions that take positions or shapes -> the named op to use instead.
_INSTEAD = {
    "concatenate": "use nm.concat(tensors, dim)",
    "stack": "use nm.stack(tensors, dim)",
    "reshape": "use nm.reshape(t, {new: size}, from_=dims)",
    "matmul": "use nm.einsum(a, b, out=...), which contracts by name",
    "dot": "use nm.einsum(a, b, out=...) or nm.dot(a, b, over=dims)",
    "tensordot": "use nm.einsum(a, b, out=...)",
    "einsum": "use nm.einsum(a, b, out=...), which contracts by name",
    "take": "use nm.gather(t, dim, indices) or nm.isel",
    "pad": "use nm.pad(t, {dim: (lo, hi)})",
    "roll": "use nm.shift(t, dim, offset, wrap=True)",
    "split": "use nm.split(t, dim, sizes)",
    "expand_dims": "use nm.expand_dims(t, dim)",
    "norm": "use nm.sqrt(nm.square(t).sum(dims))",
    "cumprod": "use nm.scan over the dim",
    "isclose": "use nm.abs(a - b) <= atol + rtol * nm.abs(b), or np.allclose for one bool",
    "argsort": "use nm.top_k(t, dim, k) for the k largest",
    "sort": "use nm.top_k(t, dim, size of dim)",
}


def apply_function(func, args, kwargs):
    """`func(*args, **kwargs)` for a NumPy function on Tensors, by name."""
    name = func.__name__
    full = func.__module__.replace("numpy", "np", 1) + "." + name
    if name in _VALUE_LEVEL:
        conv = lambda x: np.asarray(x) if type(x).__name__ == "Tensor" else x
        return func(*(conv(a) for a in args), **{k: conv(v) for k, v in kwargs.items()})
    if name not in _FUNCTIONS:
        use = _INSTEAD.get(name, "write it with the named ops (nm.einsum, nm.reshape, ...)")
        raise NumPyDispatchError(
            f"{full} on a namedmesh.Tensor has no direct named equivalent: {use}; or "
            "convert explicitly with np.asarray(t) (the dims are lost)"
        )
    target, by_axis = _FUNCTIONS[name]
    fn = getattr(_nm(), target)
    kwargs = dict(kwargs)
    if by_axis:
        x, *rest = args
        axis = kwargs.pop("axis") if "axis" in kwargs else rest.pop(0) if rest else None
        names_not_positions(axis, f"np.{name}(axis=...) on a Tensor", x.dims)
        ddof = {"ddof": kwargs.pop("ddof")} if "ddof" in kwargs and target in ("var", "std") else {}
        extra = [k for k, v in kwargs.items() if v is not None and (k, v) != ("keepdims", False)]
        if rest or extra:
            raise NumPyDispatchError(
                f"np.{name} on a Tensor takes only `axis` (dim names), as nm.{target} does; "
                f"got {sorted(extra) or len(rest) + 2} more argument(s)"
            )
        if target in ("argmax", "argmin", "cumsum") and axis is None:
            raise NumPyDispatchError(f"np.{name} on a Tensor needs axis=<a dim name of {x.dims}>")
        return fn(x, axis, **ddof) if axis is not None or target == "squeeze" else fn(x, **ddof)
    if name == "transpose" and "axes" in kwargs:
        args = (*args, kwargs.pop("axes"))
    if target == "round" and "decimals" in kwargs:  # np.round(t, decimals=2)
        args = (*args, kwargs.pop("decimals"))
    if target == "clip":  # np.clip(t, a_min=0, a_max=1), NumPy 2's min=, max=
        args = _clip_bounds(args, kwargs)
    if target.endswith("_like") and kwargs.get("dtype", 0) is None:
        del kwargs["dtype"]  # (NumPy's default: the tensor's)
    if target.endswith("_like") and "dtype" in kwargs:  # np.zeros_like(t, dtype=...)
        return fn(*args, dtype=kwargs.pop("dtype"), **_refused(name, target, kwargs))
    _refused(name, target, kwargs)
    if name == "transpose":
        x, *axes = args
        axes = axes[0] if axes else None
        names_not_positions(axes, "np.transpose on a Tensor", x.dims)
        return fn(x, *(axes if axes is not None else x.dims[::-1]))
    return fn(*args)


def _clip_bounds(args, kwargs) -> tuple:
    """np.clip's (t, lo, hi) from its positions and keywords (`a_min`/`min`, `a_max`/
    `max`, each at most once, as NumPy takes them), taken out of `kwargs`."""
    x, *rest = args
    bounds = [*rest, None, None][:2]
    for n, names in enumerate((("a_min", "min"), ("a_max", "max"))):
        given = [k for k in names if k in kwargs]
        if len(given) + (n < len(rest)) > 1:
            raise NumPyDispatchError(f"np.clip on a Tensor: {names[0]!r} given twice ({given})")
        if given:
            bounds[n] = kwargs.pop(given[0])
    return (x, *bounds)


def _refused(name: str, target: str, kwargs) -> dict:
    """`kwargs` when empty; else the NumPyDispatchError naming what nm.`target` lacks."""
    if kwargs:
        raise NumPyDispatchError(f"np.{name} on a Tensor: nm.{target} takes no {sorted(kwargs)}")
    return kwargs
