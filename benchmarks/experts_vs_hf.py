"""The MoE experts' FFN against transformers' own: Mixtral's experts module
(`MixtralExperts`, gated SiLU, top-k weights applied and summed) run with the experts
implementation transformers picks by default (`config._experts_implementation`: in
transformers 5.x "grouped_mm", `torch.nn.functional.grouped_mm`, where the torch build
has it, else its "eager" loop over the experts), and with the eager loop as well,
against namedmesh's `nm.grouped_ffn` (what the zoo's dropless MoE runs) and the
routing weights' einsum. Forward and backward of sum(out²) (the rows' and the three
weights' gradients), outputs checked equal first; benchmarks/fair.py's method."""

from __future__ import annotations

import numpy as np

from benchmarks import fair

EXPERTS, TOP_K = 8, 2


def inputs(tokens: int, d: int, f: int, seed: int = 0) -> dict:
    """x (tokens, d), wi and wg (experts, d, f), wo (experts, f, d), each token's TOP_K
    distinct experts uniformly at random and their weights (summing to 1)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d), np.float32)
    w = lambda *s: (rng.standard_normal(s) * s[-2] ** -0.5).astype(np.float32)
    choice = np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K].astype(np.int64)
    weight = rng.random((tokens, TOP_K)).astype(np.float32)
    return {
        "x": x,
        "wi": w(EXPERTS, d, f),
        "wg": w(EXPERTS, d, f),
        "wo": w(EXPERTS, f, d),
        "choice": choice,
        "weight": weight / weight.sum(1, keepdims=True),
    }


def namedmesh_programs(a: dict):
    """(forward, forward and backward: jitted functions of the arguments, the arguments)
    of nm.grouped_ffn and the weights' einsum on `a`. The routing is an argument, as a
    model computes it: a constant one, XLA would sort at compile time."""
    import jax

    import namedmesh as nm

    def out(x, wi, wg, wo, choice):
        t = lambda v, dims: nm.tensor(v, dims)
        y = nm.grouped_ffn(
            t(x, ("tokens", "d_model")),
            t(wi, ("experts", "d_model", "d_ff")),
            t(wo, ("experts", "d_ff", "out")),
            t(choice, ("tokens", "choices")),
            t(wg, ("experts", "d_model", "d_ff")),
            activation="silu",
        )
        return nm.einsum(y, t(a["weight"], ("tokens", "choices")), out=("tokens", "out")).data

    args = [jax.device_put(a[k]) for k in ("x", "wi", "wg", "wo")]
    args.append(jax.device_put(a["choice"].astype(np.int32)))
    forward = jax.jit(out)
    both = jax.jit(jax.value_and_grad(lambda *w: (out(*w) ** 2).sum(), argnums=(0, 1, 2, 3)))
    return forward, both, args


def namedmesh_side(a: dict):
    """(forward, forward and backward) of nm.grouped_ffn and the weights' einsum, jitted."""
    forward, both, args = namedmesh_programs(a)
    return (lambda: np.asarray(forward(*args)), lambda: jax_ready(both(*args)))


def jax_ready(value):
    import jax

    return jax.block_until_ready(value)


def jax_ready_call(program, args):
    """A compiled program's call on `args`, blocking until done."""
    return jax_ready(program(*args))


def transformers_experts(a: dict, implementation: str | None):
    """(the experts module, the implementation it runs): Mixtral's experts of a one-layer
    model built by transformers (`implementation` None: its default), weights from `a`."""
    import torch
    import transformers

    e, d, f = a["wi"].shape
    cfg = transformers.MixtralConfig(
        vocab_size=16,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_local_experts=e,
        num_experts_per_tok=TOP_K,
    )
    kwargs = {} if implementation is None else {"experts_implementation": implementation}
    model = transformers.MixtralForCausalLM._from_config(cfg, **kwargs)
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():  # gate_up (e, 2f, d): the gate (SiLU'd) first, as wi; down (e, d, f)
        gate_up = np.concatenate([a["wi"], a["wg"]], axis=2).transpose(0, 2, 1)
        experts.gate_up_proj.copy_(torch.tensor(np.ascontiguousarray(gate_up)))
        experts.down_proj.copy_(torch.tensor(np.ascontiguousarray(a["wo"].transpose(0, 2, 1))))
    return experts, model.config._experts_implementation


def torch_side(a: dict, experts):
    """(forward, forward and backward) of the experts module on `a`'s rows and routing."""
    import torch

    x = torch.tensor(a["x"], requires_grad=True)
    choice, weight = torch.tensor(a["choice"]), torch.tensor(a["weight"])

    def forward():
        with torch.no_grad():
            return experts(x, choice, weight).numpy()

    def both():
        value = (experts(x, choice, weight) ** 2).sum()
        value.backward()
        x.grad = None
        experts.zero_grad(set_to_none=True)
        return float(value.detach())

    return forward, both


def rows(sizes: dict[str, tuple[int, int, int]], rounds: int) -> dict:
    """{label: {side: seconds per round}} and {label: the default implementation}, per
    size (tokens, d_model, d_ff); each side's output checked against namedmesh's."""
    out, default = {}, ""
    for label, (tokens, d, f) in sizes.items():
        a = inputs(tokens, d, f)
        ours = namedmesh_side(a)
        want = ours[0]()
        sides = {"namedmesh": ours[1]}
        for impl in (None, "eager"):
            experts, name = transformers_experts(a, impl)
            fwd, both = torch_side(a, experts)
            got = fwd()
            err = np.abs(got - want).max() / np.abs(want).max()
            if err > 1e-4:
                raise SystemExit(
                    f"experts {label}: transformers' {name} output differs "
                    f"from namedmesh's by {err:.1e}"
                )
            if impl is None:
                default = name
            sides[f"transformers {name}" + (" (default)" if impl is None else "")] = both
        out[label] = fair.alternate(sides, rounds)
    return out, default
