"""namedmesh: named-axis tensors, one einsum for every contraction, and a tracer whose
graphs the `lowering` package turns into SPMD programs on a device mesh."""

import sys

from namedmesh import startup  # first: Ctrl-C under `python -m namedmesh` (its docstring)

# isort: split
from namedmesh import methods, numpy_dispatch, random  # methods: binds the ops onto Tensor
from namedmesh.attention import dot_product_attention
from namedmesh.autodiff import grad, value_and_grad
from namedmesh.chain import scan_chain
from namedmesh.checks import DimNameWarning
from namedmesh.contract import jax_gradients
from namedmesh.control import scan
from namedmesh.conv import conv, pool
from namedmesh.creation import (
    abstract,
    arange,
    full,
    full_like,
    ones,
    ones_like,
    tensor,
    zeros,
    zeros_like,
)
from namedmesh.einsum import dot, einsum, einsum_order
from namedmesh.elementwise import (
    abs,
    add,
    arctan2,
    astype,
    ceil,
    clip,
    cos,
    divide,
    equal,
    erf,
    exp,
    expm1,
    floor,
    floor_divide,
    gelu,
    greater,
    greater_equal,
    isfinite,
    isnan,
    less,
    less_equal,
    log,
    log1p,
    logical_and,
    logical_not,
    logical_or,
    logical_xor,
    maximum,
    minimum,
    mod,
    multiply,
    negative,
    not_equal,
    power,
    reciprocal,
    relu,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    sqrt,
    square,
    subtract,
    tan,
    tanh,
    where,
)
from namedmesh.errors import (
    ArgumentError,
    DtypeError,
    LayoutError,
    MeshError,
    NamedMeshError,
    NumPyDispatchError,
    ParameterError,
    PipelineError,
    ShapeError,
    TracedValueError,
)
from namedmesh.grouped import grouped_matmul
from namedmesh.grouped_ffn import grouped_ffn
from namedmesh.interop import from_xarray, to_xarray
from namedmesh.primitive import REGISTRY, Aval, Cost, Primitive, bind
from namedmesh.random import dropout
from namedmesh.reductions import (
    all,
    any,
    argmax,
    argmin,
    cumsum,
    log_softmax,
    logsumexp,
    max,
    mean,
    min,
    prod,
    softmax,
    sum,
    top_k,
)
from namedmesh.rounding import round
from namedmesh.selection import expand_dims, isel, squeeze, std, var
from namedmesh.structural import (
    concat,
    constrain,
    gather,
    one_hot,
    pad,
    rename,
    reshape,
    shift,
    split,
    stack,
    stop_gradient,
    transpose,
)
from namedmesh.structural import slice_ as slice
from namedmesh.tensor import Tensor
from namedmesh.trace import Eqn, Graph, evaluate, interpret, reference, trace
from namedmesh.update import update_slice

__version__ = "0.1.0"

# np.exp(t) runs the op of the ufunc's name from this namespace (namedmesh/numpy_dispatch.py)
numpy_dispatch.use_namespace(sys.modules[__name__])

startup.unguard()  # the package is imported: its commands take the signals over
