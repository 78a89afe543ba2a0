"""The benchmarked models, the layouts each runs under, the analytical minimum of
collective bytes per device per training step, and the hand-written shard_maps.

Models (float32; the loss is mean(out²), plus the load-balancing loss for moe;
gradients of every parameter, not of x):
- mlp:       out = relu(x·wi)·wo, x (batch, d_model);
- attention: multi-head self-attention of x (batch, length, d_model), no mask;
- layer:     a pre-norm Transformer layer (LayerNorm, causal attention, residual,
             LayerNorm, GELU FFN, residual), the zoo's `transformer.block`;
- moe:       the zoo's top-2 mixture-of-experts FFN under capacity routing (one-hot
             dispatch einsums), one group per batch row.

The minimum follows the Mesh-TensorFlow paper's analysis with ring collectives
(all-reduce 2(n-1)/n·S, all-gather and reduce-scatter (n-1)/n of the full buffer):
- every parameter's gradient is summed over the mesh axes that split the data
  (batch, length) but not the parameter: an all-reduce of its shard; over an axis
  that splits both (FSDP), the parameter is all-gathered for the forward pass and
  its gradient reduce-scattered;
- splitting heads or d_ff (Megatron) all-reduces each block's output over those axes
  in the forward pass, and its input's gradient in the backward pass when the input
  needs one (in `layer`, for the LayerNorm's parameters; not in `mlp`/`attention`,
  whose input is data);
- splitting length (sequence parallelism) all-gathers the attention's input over the
  length axes (keys and values need every position), and reduce-scatters its
  gradient when the input needs one.
- moe: the least of the two ways to bring tokens and experts together when experts
  are split: all-to-all the expert inputs (forward only: they are data dispatched by a
  one-hot, and need no gradient) and the expert outputs (both ways), as GShard does,
  or all-gather the expert weights and reduce-scatter their gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import namedmesh as nm
from lowering import Layout, Mesh
from lowering.layout import local_shape
from models import architecture as config
from models import transformer
from models.layers import common as layers
from models.layers import moe

F32 = 4


@dataclass(frozen=True)
class Case:
    """A layout of a model on a mesh; `hand` names the hand-written shard_map, if any."""

    name: str
    mesh: dict
    rules: str
    hand: bool = False


@dataclass(frozen=True)
class Model:
    """A loss of (params, x), its inputs and the layouts it runs under."""

    kind: str
    sizes: dict
    cfg: config.Config
    cases: tuple

    @property
    def name(self) -> str:
        return f"{self.kind} " + " ".join(f"{k}={v}" for k, v in self.sizes.items())

    def loss(self, p, x):
        if self.kind == "mlp":
            out = nm.einsum(nm.relu(nm.einsum(x, p["wi"])), p["wo"], out=x.dims)
        elif self.kind == "attention":
            out = layers.attention(x, p, self.cfg)
        elif self.kind == "layer":
            out, _ = transformer.block(x, p, transformer.Context(self.cfg))
        else:
            out, stats, _ = moe.moe(x, p, self.cfg)
            return (out * out).mean() + self.cfg.moe_loss * stats["balance"]
        return (out * out).mean()

    def inputs(self, seed: int = 0) -> tuple[dict, nm.Tensor]:
        cfg = self.cfg
        shapes = {
            "mlp": lambda: layers.ffn_params(cfg),
            "attention": lambda: layers.attention_params(cfg),
            "layer": lambda: transformer.layer_shapes(cfg),
            "moe": lambda: moe.moe_params(cfg),
        }[self.kind]()
        params = jax.tree_util.tree_map(
            lambda t: nm.tensor(np.asarray(t.data), t.dims),
            transformer.init(shapes, seed),
            is_leaf=lambda t: isinstance(t, nm.Tensor),
        )
        dims = ("batch", "d_model") if self.kind == "mlp" else ("batch", "length", "d_model")
        shape = [self.sizes[{"batch": "b", "length": "l", "d_model": "d"}[d]] for d in dims]
        r = np.random.default_rng(seed)
        return params, nm.tensor(r.normal(size=shape).astype(np.float32), dims)


# --- the analytical minimum ---------------------------------------------------------
def _ring(kind: str, n: int, s: float) -> float:
    return (2 if kind == "psum" else 1) * (n - 1) / n * s


def _axes(rules: str, dim: str, mesh: dict) -> tuple[str, ...]:
    """The mesh axes the layout gives `dim` of the data x (batch and length)."""
    dims = ("batch", "length", "d_model")
    lay = dict(zip(dims, Layout(rules).assign(dims), strict=True))
    return tuple(a for a in lay[dim] if mesh[a] > 1)


def _grad_sync(params: dict, case: Case, local: frozenset = frozenset()) -> float:
    """Each parameter's gradient summed over the data axes that do not split it; FSDP's
    gather and reduce-scatter over those that do, except the axes `local`, where each
    device keeps its part of the parameter (experts)."""
    mesh = Mesh(case.mesh, devices="abstract")
    data = set(_axes(case.rules, "batch", case.mesh) + _axes(case.rules, "length", case.mesh))
    data -= local
    total = 0.0
    for t in jax.tree_util.tree_leaves(params, is_leaf=lambda t: isinstance(t, nm.Tensor)):
        lay = Layout(case.rules).of(t.dims, t.shape, mesh, "parameter")
        stored = math.prod(local_shape(lay, t.shape, mesh)) * F32
        split = {a for axes in lay for a in axes}
        fsdp = math.prod(case.mesh[a] for a in split & data)
        replicated = math.prod(case.mesh[a] for a in data - split)
        total += 2 * _ring("gather", fsdp, stored * fsdp)  # gather + reduce-scatter
        total += _ring("psum", replicated, stored)
    return total


def minimum(model: Model, case: Case, params: dict) -> float:
    """The least bytes one device must send per training step (module docstring)."""
    if model.kind == "moe":
        return _moe_minimum(model, case, params)
    s, m = model.sizes, case.mesh
    n = lambda dim: math.prod(m[a] for a in _axes(case.rules, dim, m))
    split = {  # devices splitting each dim, as the rules give it to a lone dim
        d: math.prod(m[a] for a in Layout(case.rules).assign((d,))[0]) for d in ("heads", "d_ff")
    }
    tokens = s["b"] // n("batch") * s.get("l", 1) // n("length")  # per device
    act = tokens * s["d"] * F32  # one (batch, length, d_model) shard
    total = _grad_sync(params, case)
    blocks = {"mlp": [("d_ff", False)], "attention": [("heads", False)]}.get(
        model.kind, [("heads", True), ("d_ff", True)]
    )
    for dim, needs_grad in blocks:
        total += _ring("psum", split[dim], act) * (2 if needs_grad else 1)
    if model.kind in ("attention", "layer") and n("length") > 1:
        gathered = act * n("length")
        total += _ring("gather", n("length"), gathered) * (2 if model.kind == "layer" else 1)
    return total


def _moe_minimum(model: Model, case: Case, params: dict) -> float:
    """The gate's gradient sync; the expert weights' gradients summed over the data axes
    that do not split them; and, with experts split, the cheaper way to bring tokens and
    experts together: over data axes, all-to-all the expert inputs there and the expert
    outputs there and back (the expert inputs need no gradient: they are the data x
    dispatched by a one-hot pattern that no parameter's gradient flows through) or
    gather the expert weights and reduce-scatter their gradients; over other
    axes, where every device holds all its tokens, one all-reduce of the output. The
    gating's reductions over a split experts dim (softmax, top-2) are left out: this is
    a lower bound, not the exact minimum."""
    experts = {k: v for k, v in params.items() if k != "gate"}
    total = _grad_sync({"gate": params["gate"]}, case)
    cfg, s, m = model.cfg, model.sizes, case.mesh
    e_axes = set(Layout(case.rules).assign(("experts",))[0])
    n_experts = math.prod(m[a] for a in e_axes)
    data = set(_axes(case.rules, "batch", m))
    total += _grad_sync(experts, case, local=frozenset(e_axes))
    if n_experts == 1:
        return total
    n_data = math.prod(m[a] for a in e_axes & data)
    expert_w = 2 * cfg.experts * cfg.d_model * cfg.d_ff * F32 / n_experts  # stored shard
    tokens = s["b"] // math.prod(m[a] for a in data) * s["l"]
    if n_data > 1:
        slots = tokens // s["l"] * cfg.experts * moe.capacity(cfg) * cfg.d_model * F32
        gather = 2 * _ring("gather", n_data, expert_w * n_data)
        total += min(3 * _ring("a2a", n_data, slots), gather)
    n_other = n_experts // n_data
    total += _ring("psum", n_other, tokens * cfg.d_model * F32)
    return total


# --- hand-written Megatron shard_maps ---------------------------------------------
def hand_step(model: Model, case: Case, params: dict, x: nm.Tensor):
    """Megatron's MLP or attention as a jax.shard_map: weights split over the model
    axis (d_ff, or heads), one psum of the output over it; batch over the other axis,
    weight gradients psummed over it. (gradient function, its placed arguments)."""
    axes = dict(r.split(":") for r in case.rules.split(";"))
    mesh = Mesh(case.mesh).jax_mesh
    model_axis = axes["d_ff" if model.kind == "mlp" else "heads"]
    batch = axes.get("batch")
    count = x.size

    if model.kind == "mlp":
        specs = {"wi": P(None, model_axis), "wo": P(model_axis, None)}

        def block(p, x):
            return jax.nn.relu(x @ p["wi"]) @ p["wo"]

    else:
        specs = {k: P(None, model_axis, None) for k in "qkv"} | {"o": P(model_axis, None, None)}

        def block(p, x):
            q, k, v = (jnp.einsum("bld,dhk->blhk", x, p[n]) for n in "qkv")
            logits = jnp.einsum("blhk,bmhk->bhlm", q, k) * model.cfg.d_kv**-0.5
            o = jnp.einsum("bhlm,bmhk->blhk", jax.nn.softmax(logits, axis=-1), v)
            return jnp.einsum("blhk,hkd->bld", o, p["o"])

    x_spec = P(batch, *([None] * (x.ndim - 1)))

    def local(p, x):
        y = jax.lax.psum(block(p, x), model_axis)
        part = jnp.sum(y * y) / count
        return part if batch is None else jax.lax.psum(part, batch)

    f = jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=P())
    shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    grad = jax.jit(jax.grad(f), out_shardings=shardings)
    p = {k: jax.device_put(np.asarray(params[k].data), shardings[k]) for k in specs}
    return grad, (p, jax.device_put(np.asarray(x.data), NamedSharding(mesh, x_spec)))


# --- the models and their layouts --------------------------------------------------
def _mlp_cases() -> tuple:
    return (
        Case("data-parallel", {"data": 8}, "batch:data"),
        Case("model-parallel", {"model": 8}, "d_ff:model", hand=True),
        Case("2d", {"rows": 2, "cols": 4}, "batch:rows;d_ff:cols", hand=True),
        Case("2d", {"rows": 4, "cols": 2}, "batch:rows;d_ff:cols", hand=True),
        Case("fsdp", {"data": 8}, "batch:data;d_model:data"),
        Case("3d", {"data": 2, "fsdp": 2, "model": 2}, "batch:data,fsdp;d_model:fsdp;d_ff:model"),
    )


def _attention_cases() -> tuple:
    return (
        Case("data-parallel", {"data": 8}, "batch:data"),
        Case("model-parallel", {"model": 8}, "heads:model", hand=True),
        Case("2d", {"rows": 2, "cols": 4}, "batch:rows;heads:cols", hand=True),
        Case("sequence-parallel", {"data": 2, "seq": 4}, "batch:data;length:seq"),
        Case("3d", {"data": 2, "seq": 2, "model": 2}, "batch:data;length:seq;heads:model"),
    )


def _layer_cases() -> tuple:
    megatron = "heads:model;d_ff:model"
    return (
        Case("data-parallel", {"data": 8}, "batch:data"),
        Case("model-parallel", {"model": 8}, megatron),
        Case("2d", {"rows": 2, "cols": 4}, "batch:rows;heads:cols;d_ff:cols"),
        Case("fsdp", {"data": 8}, "batch:data;d_model:data"),
        Case("sequence-parallel", {"data": 2, "seq": 4}, "batch:data;length:seq"),
        Case("3d", {"data": 2, "seq": 2, "model": 2}, "batch:data;length:seq;" + megatron),
    )


def _moe_cases() -> tuple:
    return (
        Case("data-parallel", {"data": 8}, "batch:data"),
        Case("expert-parallel", {"data": 8}, "batch:data;experts:data"),
        Case("2d expert-parallel", {"data": 2, "model": 4}, "batch:data;experts:model"),
        Case("3d", {"data": 2, "expert": 2, "model": 2}, "batch:data;experts:expert;d_ff:model"),
    )


# The layouts `--quick` (and so `make test`) keeps of each larger model: every kind of
# layout still appears (the MLP keeps all of its own), at about half the compiles.
QUICK_CASES = {
    "attention": ("model-parallel", "sequence-parallel"),
    "layer": ("2d", "3d"),
    "moe": ("expert-parallel", "3d"),
}


def models(size: str) -> list[Model]:
    """The benchmarked models at `size` ("quick" or "full"): "quick" is the smallest
    sizes, and of the attention, layer and MoE models the layouts in QUICK_CASES."""
    quick = size == "quick"
    mlps = [(16, 32, 64)] if quick else [(16, 32, 64), (64, 256, 1024), (256, 1024, 4096)]
    out = [
        Model("mlp", {"b": b, "d": d, "h": h}, config.Config(d_model=d, d_ff=h, ffn="relu"),
              _mlp_cases())
        for b, d, h in mlps
    ]  # fmt: skip
    b, n, d, h, k = (8, 16, 32, 8, 8) if quick else (16, 128, 256, 8, 32)
    att = config.Config(d_model=d, heads=h, d_kv=k, d_ff=4 * d, length=n)
    sizes = {"b": b, "l": n, "d": d, "h": h, "k": k}
    pick = lambda name, cs: [c for c in cs if c.name in QUICK_CASES[name]] if quick else cs
    out.append(Model("attention", sizes, att, pick("attention", _attention_cases())))
    out.append(Model("layer", {**sizes, "f": 4 * d}, att, pick("layer", _layer_cases())))
    e = 8
    moe_cfg = att.replace(experts=e, ffn="relu", routing="capacity")  # dispatch einsums
    moe_sizes = {"b": b, "l": n, "d": d, "f": 4 * d, "e": e}
    out.append(Model("moe", moe_sizes, moe_cfg, pick("moe", _moe_cases())))
    return out
