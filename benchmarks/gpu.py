"""`python -m benchmarks.gpu [--config base] [--steps N] [--warmup N] [--dtype bfloat16]
[--peak-tflops X] [--max-seconds S] [--docs PATH]`: one device's training throughput.

The LM's training step (models.training.trainer.Trainer's lowered loss, its gradient and the
Adafactor update, one jit) on a one-device mesh, on synthetic tokens. In bfloat16 every
matmul (forward and backward) takes bfloat16 operands and accumulates in float32
(`jax.default_matmul_precision("BF16_BF16_F32")`); parameters, activations, elementwise
ops, the loss and the optimizer stay float32 (see `PRECISION`); the zoo's own compute
dtype (`Config.dtype="bfloat16"`: bf16 activations too) is not what this measures yet.
Reports tokens/s (median step time over timed steps after warm-up, each ended by
block_until_ready) and model flops utilisation against --peak-tflops (default on a GPU:
the H200's dense bf16 peak). Writes a docs section only when --docs is given. Never
needed by `make test`.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

from benchmarks import cli, report
from lowering import Mesh
from models import catalog, zoo
from models.training import trainer

SECTION = "## One GPU: base LM training step in bf16"
H200_PEAK_TFLOPS = 989.0  # dense BF16 (NVIDIA lists 1,979 with 2:4 sparsity)
# bfloat16: bf16 operands, f32 accumulation in every dot, float32 activations. Written
# before the zoo had a compute dtype (Config.dtype), which this benchmark does not use yet.
PRECISION = {"bfloat16": "BF16_BF16_F32", "float32": "float32"}
MATMULS = ("q", "k", "v", "o", "wi", "wo", "wg")  # the layer parameters used as matmuls


class BenchError(Exception):
    """A setting the benchmark cannot run with."""


def model_flops_per_token(cfg) -> float:
    """Training flops per token, PaLM's convention (Chowdhery et al. 2022, app. B):
    6·N + 12·L·T·H·Q, where N counts the matmul parameters (the layers' q, k, v, o, wi,
    wo[, wg] and the d_model x vocab output projection; not the embedding lookup, the
    positions or the norms), L layers, T the length, H·Q = heads·d_kv. Attention is
    counted over all T positions, as it is computed (the causal mask discards half)."""
    shapes = zoo.get("lm").shapes(cfg)
    n = sum(
        int(np.prod(list(p.sizes.values())))
        for block in shapes["layers"].values()
        for name, p in block.items()
        if name in MATMULS
    )
    n += cfg.d_model * cfg.vocab
    return 6 * n + 12 * cfg.layers * cfg.length * cfg.heads * cfg.d_kv


def measure(cfg_name: str, steps: int, warmup: int, dtype: str, max_seconds: float) -> dict:
    """Compile, then run `warmup` + up to `steps` training steps (fewer if `max_seconds`
    runs out); return the config, step times, compile time, losses and HLO dot counts."""
    if steps < 1 or warmup < 1:
        raise BenchError(f"--steps and --warmup must be >= 1, got {steps} and {warmup}")
    if dtype not in ("bfloat16", "float32"):
        raise BenchError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    start = time.perf_counter()
    model = zoo.get("lm")
    cfg = model.configure(catalog.get(cfg_name))
    opt, _ = trainer.optimizer(trainer.OptimizerSpec("adafactor", 1e-3, steps + warmup, 0, 0.0))
    tr = trainer.Trainer(model, cfg, Mesh({"batch": 1}), "batch:batch", trainer.TrainSpec(opt))
    state = tr.init_state()

    def update(state, batch):
        loss, grads = jax.value_and_grad(lambda p: tr.lowered(p, batch, None).data)(state["params"])
        updates, opt_state = tr.opt.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates),
                "opt": opt_state}, loss  # fmt: skip

    step = jax.jit(update, donate_argnums=(0,))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.length + 1), dtype=np.int32)
    batch = tr.place_batch(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
         "weights": np.ones((cfg.batch, cfg.length), np.float32)}
    )  # fmt: skip
    with jax.default_matmul_precision(PRECISION[dtype]):  # traced (and keyed) under it
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        times, losses = _loop(compiled, state, batch, warmup, steps, start, max_seconds)
    dots = _dots(compiled.as_text())
    if not all(np.isfinite(losses)):
        raise BenchError(f"non-finite loss in {dtype}: {losses}")
    return {"name": cfg_name, "cfg": cfg, "times": times, "compile_s": compile_s,
            "losses": losses, "dots": dots, "report": tr.report()}  # fmt: skip


def _dots(hlo: str) -> tuple[int, int]:
    """(dots computed with bf16 operands, all dots) in compiled HLO text."""
    lines = [ln for ln in hlo.splitlines() if " dot(" in ln]
    return sum("algorithm=dot_bf16_bf16_f32" in ln for ln in lines), len(lines)


def _loop(step, state, batch, warmup, steps, start, max_seconds):
    """(timed step seconds, every loss): `warmup` untimed steps, then up to `steps` timed
    ones; past `max_seconds` from `start` the warm-up ends and timing stops after one."""
    times, losses, i = [], [], 0
    while len(times) < steps:
        t0 = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= warmup:
            times.append(dt)
        i += 1
        if time.perf_counter() - start > max_seconds:
            if times:
                break
            warmup = i  # out of time in the warm-up: time the next step and stop
    return times, losses


def summary(m: dict, dtype: str, peak_tflops: float | None) -> dict:
    """Tokens/s, model flops per token (formula and cost model) and MFU of a `measure`."""
    cfg, step_s = m["cfg"], statistics.median(m["times"])
    tokens = cfg.batch * cfg.length
    per_token = model_flops_per_token(cfg)
    achieved = per_token * tokens / step_s
    return {
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "name": m["name"],
        "config": cfg,
        "dtype": dtype,
        "step_s": step_s,
        "step_s_p10_p90": tuple(np.percentile(m["times"], [10, 90])),
        "timed_steps": len(m["times"]),
        "compile_s": m["compile_s"],
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "flops_per_token": per_token,
        "cost_model_flops_per_token": (m["report"].flops + m["report"].backward_flops) / tokens,
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": peak_tflops,
        "mfu": achieved / (peak_tflops * 1e12) if peak_tflops else None,
        "bf16_dots": m["dots"],
        "first_loss": m["losses"][0],
        "last_loss": m["losses"][-1],
    }


def text(s: dict, command: str) -> str:
    cfg = s["config"]
    lo, hi = s["step_s_p10_p90"]
    mfu = "n/a (no peak for this device; pass --peak-tflops)" if s["mfu"] is None else (
        f"{100 * s['mfu']:.1f}% of {s['peak_tflops']:g} TFLOPS"
        + (" (the H200's dense bf16 peak)" if s["peak_tflops"] == H200_PEAK_TFLOPS else "")
    )  # fmt: skip
    warn = ""
    if s["platform"] != "gpu":
        warn = (
            f"**This run was on {s['platform'].upper()} ({s['device']}), not a GPU: it "
            "checks the script, and its figures say nothing about GPU throughput.**\n\n"
        )
    model = (
        f"LM `{s['name']}`: d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads "
        f"× d_kv {cfg.d_kv}, d_ff {cfg.d_ff}, vocab {cfg.vocab}"
    )
    step = f"{1e3 * s['step_s']:.2f} ms ({1e3 * lo:.2f}–{1e3 * hi:.2f}), {s['timed_steps']} steps"
    modelled = s["cost_model_flops_per_token"]
    per_token = f"{s['flops_per_token']:,.0f} (cost model, forward + backward: {modelled:,.0f})"
    rows = [
        ["device", f"{s['device']} ({s['platform']}), jax {jax.__version__}"],
        ["model", model],
        ["tokens per step", f"{s['tokens_per_step']:,} (batch {cfg.batch} × length {cfg.length})"],
        ["step time, median (p10–p90)", step],
        ["tokens/s", f"{s['tokens_per_s']:,.0f}"],
        ["model flops per token", per_token],
        ["achieved", f"{s['achieved_tflops']:.2f} TFLOPS"],
        ["model flops utilisation", mfu],
        ["compile", f"{s['compile_s']:.1f} s"],
        ["dots with bf16 operands (compiled HLO)", "{} of {}".format(*s["bf16_dots"])],
        ["loss, first → last step", f"{s['first_loss']:.3f} → {s['last_loss']:.3f}"],
    ]
    return f"""{SECTION}

Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC.

{warn}{report.md_table(["", "value"], rows)}

Method: the training step of `models.training.trainer.Trainer` (the lowered LM loss on a
one-device mesh, `jax.value_and_grad`, Adafactor), one `jax.jit`, compiled ahead, on a
fixed batch of random tokens. Precision: {_precision(s["dtype"])} Step time is the
median of the timed steps after the warm-up steps, each ended by
`jax.block_until_ready`. Tokens/s = batch × length / step time. Model flops per token =
6·N + 12·L·T·H·Q (PaLM's convention): N the matmul parameters (attention q, k, v, o,
FFN wi, wo and the d_model × vocab output projection; not the embedding lookup,
positions or norms), L layers, T the length, H·Q = heads × d_kv; the cost model's forward
flops ×3 per token are shown beside it. MFU = model flops per token × tokens/s / peak.
"""


def _precision(dtype: str) -> str:
    if dtype == "bfloat16":
        return (
            "every matmul, forward and backward, took bfloat16 operands with float32 "
            'accumulation (`jax.default_matmul_precision("BF16_BF16_F32")`; the HLO '
            "count above checks it); parameters, activations in memory, elementwise ops, "
            "softmax, the loss, gradients and the optimizer were float32. Not bfloat16 "
            "parameters: namedmesh's dtype promotion does not treat bfloat16 (NumPy kind "
            "`V`) as a float, so a bfloat16 model turns float32 at the causal mask and "
            "the layer scan rejects the changed carry."
        )
    return "everything in float32, matmuls at full float32 precision (no TF32)."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    ap.add_argument("--config", default="base")
    ap.add_argument("--steps", type=cli.count, default=50, help="timed steps (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help=f"device peak for MFU (default on a GPU: {H200_PEAK_TFLOPS:g}, "
                    "the H200's dense bf16)")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="stop timing after this long; the process is killed at +45 s")  # fmt: skip
    ap.add_argument("--docs", type=Path, help="write the section into this markdown file")
    args = ap.parse_args(argv)
    # the hard bound: a watchdog thread ends the process even inside a hung compile
    faulthandler.dump_traceback_later(args.max_seconds + 45, exit=True)
    try:
        peak = args.peak_tflops
        kind = jax.devices()[0].device_kind
        if peak is None and jax.devices()[0].platform == "gpu":
            peak = H200_PEAK_TFLOPS
            if "H200" not in kind:
                print(f"warning: MFU is against the H200's peak, and this is {kind}; "
                      "pass --peak-tflops", file=sys.stderr)  # fmt: skip
        m = measure(args.config, args.steps, args.warmup, args.dtype, args.max_seconds)
        s = summary(m, args.dtype, peak)
    except (BenchError, KeyError) as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"device: {s['device']} ({s['platform']})")
    print(f"step: {1e3 * s['step_s']:.3f} ms median over {s['timed_steps']} steps")
    print(f"tokens/s: {s['tokens_per_s']:.1f}")
    print(f"model flops/token: {s['flops_per_token']:,.0f}; achieved {s['achieved_tflops']:.3f} "
          "TFLOPS; MFU: " + ("n/a" if s["mfu"] is None else f"{100 * s['mfu']:.2f}%"))  # fmt: skip
    if args.docs:
        report.write_section(args.docs, SECTION, text(s, report.command("benchmarks.gpu", argv)))
        print(f"wrote {SECTION!r} in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
