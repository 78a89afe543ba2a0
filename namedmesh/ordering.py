"""The order NumPy's comparisons give values, as jax code can rely on it.

NumPy's max, argmax, argsort and friends compare with `<` and `==`: -0.0 equals
0.0, and every NaN (whatever its sign bit) wins a max or a min and ties to the
first index. `jax.lax.top_k` and XLA's max differ: top_k orders floats totally
(-NaN < -inf < ... < -0.0 < 0.0 < ... < NaN), and an all-reduce max may drop a NaN.
`sort_key` maps values to keys on which `jax.lax.top_k` orders as NumPy does; the
lowering's rules and the ops' jax implementations use it, so that eager jax, the
NumPy reference and every layout agree.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def lowest(dtype) -> np.generic:
    """The identity of max for `dtype`: False, the smallest integer, or -inf."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return np.bool_(False)
    if dt.kind in "iu":
        return np.iinfo(dt).min
    return dt.type(-np.inf)


def sort_key(x, largest: bool = True):
    """Keys of the jax array `x` on which `jax.lax.top_k` (descending, the lower index
    first on ties) picks what NumPy's argmax (`largest`) or argmin picks: NaNs first,
    -0.0 tied with 0.0. Booleans become uint8; integers keep their width (a minimum
    is found by the bitwise complement, exact for signed and unsigned values)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x if largest else ~x
    zero = jnp.zeros((), x.dtype)
    key = jnp.where(x == zero, zero, x if largest else -x)  # -0.0 -> 0.0 (XLA folds x + 0)
    return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, x.dtype), key)
