"""Every public function, class, method and property of namedmesh and lowering states
its contract in a docstring; `help(nm.einsum)` reaches the einsum rules themselves."""

import inspect
import types

import lowering
import namedmesh as nm
import namedmesh.testing

MODULES = [nm, nm.random, namedmesh.testing, lowering]


def _public(obj):
    return {n: getattr(obj, n) for n in dir(obj) if not n.startswith("_")}


def _own_members(cls):
    """Public methods and properties that `cls` defines itself (not object's or list's)."""
    out = {}
    for n, v in vars(cls).items():
        if n.startswith("_") and n not in ("__init__", "__call__"):
            continue
        if isinstance(v, property | types.FunctionType | classmethod | staticmethod):
            out[n] = v.fget if isinstance(v, property) else getattr(v, "__func__", v)
    return out


def undocumented() -> list[str]:
    missing = []
    for mod in MODULES:
        for name, obj in _public(mod).items():
            if isinstance(obj, types.ModuleType) or not callable(obj):
                continue
            if getattr(obj, "__module__", "").split(".")[0] not in ("namedmesh", "lowering"):
                continue
            where = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
            if not (obj.__doc__ or "").strip():
                missing.append(where)
            if inspect.isclass(obj):
                for m, f in _own_members(obj).items():
                    if m == "__init__" and obj.__doc__:
                        continue
                    if not (getattr(f, "__doc__", None) or "").strip():
                        missing.append(f"{where}.{m}")
    return sorted(set(missing))


def test_every_public_name_has_a_docstring():
    assert undocumented() == []


def test_help_of_einsum_explains_the_rules():
    doc = inspect.getdoc(nm.einsum)
    for phrase in ["summed", "out", "exactly one operand", "opt_einsum"]:
        assert phrase in doc, phrase
    assert "module docstring" not in doc
