"""The machine's single-thread matmul peak and a step's matmul flops, so that a step's
time can be read as a fraction of what the CPU's matmul kernels reach.

`matmul_peak` times one fp32 2048^3 matmul by PyTorch and by XLA (each on one thread,
the caller's `fair.single_threaded`), alternated; the peak is the faster of the two.
`step_flops` counts a training step's matmul flops from a transformers config (the
forward's projections, attention's two batched products over every (query, key) pair,
the FFN and the output layer; the backward twice the forward), the same count for both
sides of a comparison, so the fraction says how close each comes to the peak."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks import fair

PEAK_SIZE = 2048


def matmul_peak(rounds: int = 5) -> dict[str, float]:
    """{"PyTorch": GFLOP/s, "XLA": GFLOP/s, "peak": the larger}: the best of `rounds`
    alternated fp32 PEAK_SIZE^3 matmuls, timed by process time (one thread each)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((PEAK_SIZE, PEAK_SIZE), np.float32) for _ in range(2))
    ta, tb = torch.tensor(a), torch.tensor(b)
    ja, jb = jax.device_put(a), jax.device_put(b)
    dot = jax.jit(jnp.matmul)
    times = fair.alternate(
        {"PyTorch": lambda: torch.matmul(ta, tb), "XLA": lambda: dot(ja, jb).block_until_ready()},
        rounds,
    )
    flops = 2 * PEAK_SIZE**3
    out = {side: flops / min(ts) / 1e9 for side, ts in times.items()}
    return {**out, "peak": max(out.values())}


@dataclass(frozen=True)
class Shape:
    """What a step's matmul flops depend on. `ffn_mats`: the FFN's weight matrices (3
    gated, 2 not); `active`: experts each token runs (1 for a dense FFN); `experts`: the
    router's outputs (0 without one); `shared_ff`: a shared expert's gated FFN width beside
    the routed ones (Qwen2-MoE's, 0 without); `head_transform`: a masked LM's d_model x
    d_model transform before its output layer (BERT's, RoBERTa's, DistilBERT's)."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    d_ff: int
    ffn_mats: int
    vocab: int
    active: int = 1
    experts: int = 0
    shared_ff: int = 0
    head_transform: bool = False


# transformers' model types whose FFN has no gate (2 matrices, not 3)
UNGATED = {"gpt2", "gpt_neox", "opt", "bert", "roberta", "distilbert"}
MASKED_LM = {"bert", "roberta", "distilbert"}
# products Shape does not describe: T5's decoder and cross-attention, DeepSeek-V3's
# latent attention and its dense first layers
NOT_COUNTED = {"t5": "an encoder-decoder", "deepseek_v3": "latent attention"}


def shape_of(hf) -> Shape:
    """The Shape of a transformers config of the zoo's decoders and encoders (Llama's
    field names, or GPT-2's, OPT's, DistilBERT's); raises KeyError naming a field it
    lacks, or a model type whose products Shape does not describe (NOT_COUNTED)."""
    kind = getattr(hf, "model_type", None)
    if kind in NOT_COUNTED:
        raise KeyError(f"{kind}: {NOT_COUNTED[kind]}, not counted by benchmarks/peak.py")
    get = lambda *names, default=None: next(
        (getattr(hf, n) for n in names if getattr(hf, n, None) is not None), default
    )
    d = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    if d is None or heads is None:
        raise KeyError(f"{type(hf).__name__}: no hidden_size/n_embd or num_attention_heads")
    experts = get("num_local_experts", "num_experts", default=0)
    shared = get("shared_expert_intermediate_size", default=0)
    return Shape(
        layers=get("num_hidden_layers", "n_layer"),
        d_model=d,
        heads=heads,
        kv_heads=get("num_key_value_heads", default=heads),
        head_dim=get("head_dim", default=d // heads),
        d_ff=get("moe_intermediate_size" if experts else "intermediate_size",
                 "intermediate_size", "n_inner", "ffn_dim", "hidden_dim", default=4 * d),
        ffn_mats=2 if kind in UNGATED or hasattr(hf, "n_embd") else 3,
        vocab=get("vocab_size"),
        active=get("num_experts_per_tok", default=1),
        experts=experts + (1 if shared else 0),  # a shared expert's gate: one more output
        shared_ff=shared,
        head_transform=kind in MASKED_LM,
    )  # fmt: skip


def step_flops(s: Shape, batch: int, length: int) -> int:
    """Matmul flops of one training step (forward and backward) of `batch` sequences of
    `length` tokens: 3x the forward's (the backward computes each product's two
    gradients); attention counted over every (query, key) pair, as both sides compute
    it; embedding lookups, norms and elementwise work not counted."""
    tokens = batch * length
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_token = (
        2 * s.d_model * (q + 2 * kv)
        + 2 * q * s.d_model  # q, k, v and output projections
        + 4 * length * q  # scores and values: 2 products over `length` keys
        + 2 * s.ffn_mats * s.d_model * s.d_ff * s.active  # the FFN (each active expert)
        + 2 * s.d_model * s.experts  # the router
        + 2 * 3 * s.d_model * s.shared_ff  # a shared expert (gated)
    )
    head = 2 * s.d_model * (s.vocab + (s.d_model if s.head_transform else 0))
    forward = tokens * (s.layers * per_token + head)
    return 3 * forward


def fraction(flops: int, seconds: float, peak_gflops: float) -> float:
    """The fraction of the peak that `flops` in `seconds` reach."""
    return flops / seconds / (peak_gflops * 1e9)
