"""Every family in models/families/ against transformers, eager and under
`torch.compile` (`python -m benchmarks.zoo_vs_hf --families`): each family's model built
by transformers from a small config (its options as tests/test_families.py's cases set
them: grouped-query heads, windows, caps, partial rotary...), saved, loaded with
`models.io.hub.load`, its logits and first training loss checked equal, then the forward
pass and a training step (cross-entropy against random targets, backward, AdamW) of each
side timed by benchmarks/fair.py (single-threaded, CPU time, alternated)."""

from __future__ import annotations

import tempfile
import time

import jax
import numpy as np
import optax

import namedmesh as nm
from benchmarks import fair, peak
from models import zoo
from models.io import hub

TOLERANCE = 1e-4  # max |difference| of the logits over the largest, float32


def configs(layers: int, d: int, heads: int, vocab: int, length: int) -> dict:
    """family -> (transformers model class name, config class name, config kwargs)."""
    kv, ff, half = max(1, heads // 2), 2 * d, {"partial_rotary_factor": 0.5}
    llama = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv,
                 max_position_embeddings=length)  # fmt: skip
    encoder = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ff,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   max_position_embeddings=length + 2)  # fmt: skip
    window = dict(sliding_window=length // 4)
    gemma = dict(llama, head_dim=d // heads)
    mha = {k: v for k, v in llama.items() if k != "num_key_value_heads"}
    return {
        "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
            vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=length,
            bos_token_id=0, eos_token_id=0)),
        "llama": ("LlamaForCausalLM", "LlamaConfig", llama),
        "mistral": ("MistralForCausalLM", "MistralConfig", {**llama, **window}),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", llama),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", llama),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", {
            **llama, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
        "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {
            **mha, "rope_parameters": {
                "rope_type": "default", "rope_theta": 1e4, **half}}),
        "opt": ("OPTForCausalLM", "OPTConfig", dict(
            vocab_size=vocab, hidden_size=d, ffn_dim=ff, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=length, pad_token_id=1)),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", gemma),
        "granite": ("GraniteForCausalLM", "GraniteConfig", dict(
            llama, embedding_multiplier=3.0, attention_multiplier=0.3, residual_multiplier=0.5,
            logits_scaling=4.0)),
        "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {
            **gemma, **window, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}),
        "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", {
            **gemma, **window, "sliding_window_pattern": 2}),
        "t5": ("T5ForConditionalGeneration", "T5Config", dict(
            vocab_size=vocab, d_model=d, d_ff=ff, d_kv=d // heads, num_layers=layers,
            num_heads=heads)),
        "bert": ("BertForMaskedLM", "BertConfig", encoder),
        "roberta": ("RobertaForMaskedLM", "RobertaConfig", {**encoder, "type_vocab_size": 1}),
        "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(
            vocab_size=vocab, dim=d, hidden_dim=ff, n_layers=layers, n_heads=heads,
            max_position_embeddings=length)),
        "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(  # 8 experts, top-2
            llama, num_local_experts=8, num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(  # and a shared expert
            llama, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=d // 2,
            shared_expert_intermediate_size=d)),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
            llama, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=d // 2,
            norm_topk_prob=True)),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(  # a dense layer, MoE
            llama, num_key_value_heads=heads, moe_intermediate_size=d // 2, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=d // 2, q_lora_rank=d,
            qk_rope_head_dim=max(2, d // heads // 4 * 2), qk_nope_head_dim=d // heads,
            v_head_dim=d // heads, num_nextn_predict_layers=0)),
    }  # fmt: skip


def torch_sides(model, ids: np.ndarray, targets: np.ndarray, decodes: bool, compile: bool):
    """{"PyTorch eager": (forward, step), "torch.compile": (forward, step)}: transformers'
    forward pass without gradients, and a training step (cross-entropy of the logits
    against `targets`, backward, AdamW), the same model and optimizer either way; the
    compiled side by inductor, which needs the machine's C++ compiler."""
    import torch

    t_ids, t_targets = torch.tensor(ids).long(), torch.tensor(targets).long()
    extra = {"decoder_input_ids": t_ids} if decodes else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def logits_of(ids):
        return model(input_ids=ids, **extra).logits

    def loss_of(ids, targets):
        return torch.nn.functional.cross_entropy(logits_of(ids).flatten(0, 1), targets.flatten())

    sides = {"PyTorch eager": torch_pair(opt, logits_of, loss_of, t_ids, t_targets)}
    if compile:  # compiled at its first call (`family` runs it once)
        # dynamo keeps compiled code per function and, past its recompile limit (8),
        # runs it eagerly without a word: each family starts afresh
        torch._dynamo.reset()
        compiled = torch.compile(logits_of), torch.compile(loss_of)
        sides["torch.compile"] = torch_pair(opt, *compiled, t_ids, t_targets)
    return sides


def torch_pair(opt, logits, loss, ids, targets):
    """(forward, step) on these tensors: `logits(ids)` without gradients, and a training
    step of `loss(ids, targets)` (backward, `opt`), which returns the loss."""
    import torch

    def forward():
        with torch.no_grad():
            return logits(ids)

    def step():
        value = loss(ids, targets)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(value.detach())

    return forward, step


def zoo_sides(loaded, batch: dict, targets: np.ndarray):
    """(forward, step, first loss, compile): the zoo's jitted forward pass and training
    step (the same loss, AdamW with PyTorch's settings), the step run once for its first
    loss; compile: (wall, CPU) seconds of lowering and compiling both."""
    cfg, family = loaded.config, loaded.family
    opt = optax.adamw(1e-4, weight_decay=0.01)
    logits = lambda p: hub.forward(p, batch, cfg, family).transpose("batch", "length", "vocab")
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(logits(p).data,
                                                                     targets).mean()  # fmt: skip

    @jax.jit
    def step(state):
        value, grads = jax.value_and_grad(loss)(state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt_state}, value

    state = {"params": loaded.params, "opt": opt.init(loaded.params)}
    wall, cpu = time.perf_counter(), time.process_time()
    forward = jax.jit(lambda p: logits(p).data).lower(loaded.params).compile()
    step = step.lower(state).compile()
    compile_s = (time.perf_counter() - wall, time.process_time() - cpu)
    state, first = step(state)

    def train():
        nonlocal state
        state, value = step(state)
        value.block_until_ready()

    return lambda: forward(loaded.params).block_until_ready(), train, float(first), compile_s


def experts_path(model) -> str:
    """transformers' experts implementation the model runs ("" for a dense model)."""
    config = model.config
    if not any(
        getattr(config, k, 0) for k in ("num_local_experts", "num_experts", "n_routed_experts")
    ):
        return ""
    return getattr(config, "_experts_implementation", None) or "?"


def built(name: str, spec: tuple, ids: np.ndarray):
    """(transformers model, the zoo's model loaded from its saved folder, the zoo's batch
    of `ids`, whether it decodes): the family's model built from `spec` (configs's),
    every weight perturbed."""
    import torch
    import transformers

    model_cls, config_cls, kwargs = spec
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # non-trivial biases and norm scales
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    folder = tempfile.mkdtemp(prefix=f"zoo_{name}_")
    model.save_pretrained(folder)
    loaded = hub.load(folder)
    # an encoder-decoder (T5) decodes the same ids it encodes
    decodes = "decoder_inputs" in zoo.MODELS[hub.FAMILIES[name].model].needs
    batch = {"inputs": nm.tensor(ids, ("batch", "length"))}
    if decodes:
        batch["decoder_inputs"] = batch["inputs"]
    return model, loaded, batch, decodes


def family(name: str, spec: tuple, ids: np.ndarray, targets: np.ndarray, compile: bool) -> dict:
    """One family's sides, checked: {"sides": {side: (forward, step)}, "failed", "error"
    (max |logit difference| relative to the largest), "losses" (zoo's and PyTorch's first
    training loss), "compile" ({side: wall seconds of its compile}: namedmesh's lower and
    compile of both passes; torch.compile's first forward and step, which compile them
    and run them once), "compile_cpu" (namedmesh's CPU seconds), "flops" (the step's
    matmul flops, benchmarks/peak.py; None where it does not count them, "why")}."""
    model, loaded, batch, decodes = built(name, spec, ids)
    t_sides, failed = torch_sides(model, ids, targets, decodes, compile), {}
    want = t_sides["PyTorch eager"][0]().numpy()
    got = np.asarray(loaded.logits(ids, **({"decoder_input_ids": ids} if decodes else {}))
                     .transpose("batch", "length", "vocab").data)  # fmt: skip
    error = float(np.abs(got - want).max() / np.abs(want).max())
    z_forward, z_step, z_loss, (wall, cpu) = zoo_sides(loaded, batch, targets)
    t_loss = t_sides["PyTorch eager"][1]()  # the first step of each, from the same weights
    compile_s = {"namedmesh": wall}
    for side, (forward, step) in list(t_sides.items())[1:]:
        start = time.perf_counter()
        try:
            forward(), step()
        except Exception as e:  # noqa: BLE001 - a compiler missing: the table says why
            failed[side] = fair.why_not(e)
            del t_sides[side]
        else:  # wall clock: inductor compiles in child processes, which CPU time misses
            compile_s[side] = time.perf_counter() - start
    sides = {"namedmesh": (z_forward, z_step), **t_sides}
    rows, length = ids.shape
    try:
        flops, why = peak.step_flops(peak.shape_of(model.config), rows, length), ""
    except KeyError as e:
        flops, why = None, str(e).strip("'\"")
    return {"sides": sides, "failed": failed, "error": error, "losses": (z_loss, t_loss),
            "compile": compile_s, "compile_cpu": cpu, "flops": flops, "why": why,
            "experts": experts_path(model)}  # fmt: skip


def run(args, names: list[str], peak_gflops: float | None = None) -> dict:
    """{family: {"forward", "step": {side: seconds per round}, "failed", "error",
    "losses"}}: each family's forward pass, then its training step, timed alternated;
    each family's rows of `table` printed as it is done (a long run cut short keeps
    them)."""
    specs = configs(args.layers, args.d_model, args.heads, args.vocab, args.length)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, args.vocab, (args.batch, args.length)).astype(np.int32)
    targets = rng.integers(2, args.vocab, (args.batch, args.length)).astype(np.int32)
    out = {}
    for name in names:
        r = family(name, specs[name], ids, targets, args.compile)
        z_loss, t_loss = r["losses"]
        if r["error"] > TOLERANCE or abs(z_loss - t_loss) > TOLERANCE * max(1.0, abs(t_loss)):
            # timing two different computations would say nothing
            raise SystemExit(f"{name}: the zoo differs from transformers: logits by "
                             f"{r['error']:.1e}, first loss {z_loss:.6f} against "
                             f"{t_loss:.6f}")  # fmt: skip
        sides = r.pop("sides")
        for i, what in enumerate(("forward", "step")):
            r[what] = fair.alternate({n: fns[i] for n, fns in sides.items()}, args.repeats)
        out[name] = r
        print(f"{name}, load {fair.load()}:\n{table({name: r}, peak_gflops)}\n", flush=True)
    return out


def table(results: dict, peak_gflops: float | None = None) -> str:
    """Two markdown tables, the forward pass and the training step, a row per family;
    the step's table also gives each side's compile seconds and, with `peak_gflops`
    (benchmarks/peak.py's matmul peak), the step's matmul flops and the fraction of the
    peak each side reaches by its min (the forward's: a third of the step's flops)."""
    failed = {name: r["failed"] for name, r in results.items()}
    diff = {name: f"{r['error']:.1e}" for name, r in results.items()}
    loss = {name: "{:.5f} / {:.5f}".format(*r["losses"]) for name, r in results.items()}
    forward = {name: r["forward"] for name, r in results.items()}
    step = {name: r["step"] for name, r in results.items()}
    fwd_lines = fair.table(forward, "family", failed, ("max logit diff", diff))
    step_lines = fair.table(step, "family", failed, ("first loss namedmesh / PyTorch", loss))
    sides = fair.table_sides(step, failed)
    compiles = {f"{s} compile s": {n: compile_cell(r, s) for n, r in results.items()}
                for s in sides if s != "PyTorch eager"}  # fmt: skip
    experts = {n: r.get("experts") or "—" for n, r in results.items()}
    step_lines = fair.with_columns(step_lines, compiles | {"transformers' experts": experts})
    if peak_gflops:
        fwd_lines = fair.with_columns(fwd_lines, peak_columns(forward, results, peak_gflops, 3))
        step_lines = fair.with_columns(step_lines, peak_columns(step, results, peak_gflops, 1))
    return "\n".join([
        "Forward pass:", "", *fwd_lines, "",
        "Training step (forward, backward, AdamW):", "", *step_lines,
    ])  # fmt: skip


def compile_cell(r: dict, side: str) -> str:
    """A side's compile seconds (namedmesh's wall and CPU), "—" where it compiles nothing
    or did not run."""
    if side not in r.get("compile", {}):
        return "—"
    cpu = f" (CPU {r['compile_cpu']:.1f})" if side == "namedmesh" else ""
    return f"{r['compile'][side]:.1f}{cpu}"


def peak_columns(times: dict, results: dict, peak_gflops: float, share: int) -> dict:
    """{column: {family: cell}}: the matmul GFLOP of the pass (the step's over `share`)
    and each side's % of the peak by its min."""
    flops = {n: r["flops"] and r["flops"] / share for n, r in results.items()}
    cols = {"matmul GFLOP": {n: f"{f / 1e9:.1f}" if f else f"— ({results[n]['why']})"
                             for n, f in flops.items()}}  # fmt: skip
    for side in dict.fromkeys(s for t in times.values() for s in t):
        cols[f"{side} % of peak"] = {
            n: f"{100 * peak.fraction(flops[n], min(t[side]), peak_gflops):.0f}%"
            if flops[n] and side in t
            else "—"
            for n, t in times.items()
        }
    return cols
