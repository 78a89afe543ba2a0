"""`python -m benchmarks.paper [--docs PATH]`: the Mesh-TensorFlow paper's LM1B language
models on the paper's mesh shapes (32 to 512 cores), planned without devices.

For every `lm1b_*` config: the cost model's per-device flops, collective bytes and peak
memory of the forward pass and of the training step (`lower(...).report(wrt=0)` on an
abstract mesh: the backward pass as jax transposes the plan, gradient syncs included),
and a step time predicted under stated TPU assumptions (`HARDWARE`), an estimate.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import jax

import namedmesh as nm
from benchmarks import cli, report
from lowering import Mesh, lower, rates
from lowering.layout import Layout, local_shape
from models import architecture as config
from models import catalog, transformer
from models.training import objectives

SECTION = "## Paper scale: the LM1B models on 512 cores (no devices)"
CONFIGS = tuple(f"lm1b_{'m1' if k < 0 else k}" for k in sorted(config.PAPER_PARAMS))
BYTES = 4  # the planned params and activations are float32 (the paper ran bf16 activations)

# Per-TensorCore peak and collective bandwidth, from lowering/rates.py's hardware table
# (its sources there): a ring along one mesh axis of a 2-D torus uses 2 of a chip's 4 ICI
# ports, and the chip's 2 cores share them, so a core sends at about one port's rate.
# No latency, no contention, no overlap, as the page says.
HARDWARE = {
    label: {
        "peak_flops": rates.hardware(name).flops_per_s,
        "link_bytes_per_s": rates.hardware(name).bytes_per_s["psum"],
        "source": rates.hardware(name).source,
    }
    for label, name in (("TPUv2", "tpu_v2"), ("TPUv3", "tpu_v3"))
}

# What the stored sources publish for these models: tensor2tensor's docstring of
# mtf_transformer_paper_lm (tensorflow/tensor2tensor, tensor2tensor/models/
# mtf_transformer.py): parameters and per-token log-perplexity after 136,000 steps.
# The paper's own table (arXiv 1811.02084) was not found in the stored sources.
T2T_LOG_PPL = {-1: 3.209, 0: 3.119, 1: 3.037, 2: 2.969, 3: 2.912, 4: 2.874, 5: 2.871}
T2T_STEPS = 136_000

METRICS = (
    "parameters (billions)",
    "parameter bytes per device",
    "forward flops per device",
    "training-step flops per device (forward + backward)",
    "forward collective bytes per device",
    "training-step collective bytes per device (forward + backward)",
    "forward peak memory per device (estimate)",
    *(f"predicted step seconds, {hw} (estimate)" for hw in HARDWARE),
)


def _size(name: str) -> int:
    return -1 if name.endswith("m1") else int(name.rsplit("_", 1)[1])


def mesh_text(cfg) -> str:
    return "x".join(f"{a}={n}" for a, n in cfg.mesh)


def _tensors(tree) -> list[nm.Tensor]:
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda t: isinstance(t, nm.Tensor))


def param_bytes(cfg, mesh: Mesh) -> float:
    """Bytes of one device's parameter shards."""
    layout = Layout(cfg.layout)
    return sum(
        math.prod(local_shape(layout.of(t.dims, t.shape, mesh, "parameter"), t.shape, mesh)) * BYTES
        for t in _tensors(transformer.abstract(transformer.lm_shapes(cfg)))
    )


def forward_minimum(cfg, mesh: Mesh) -> float:
    """The paper's hand analysis of the forward pass's traffic: with heads and d_ff split
    over `model` (m devices), each layer all-reduces its attention and FFN outputs
    (batch, length, d_model) once, and a vocab split adds one for the embedding lookup;
    2(n-1)/n of the per-device activation each. Per-position loss scalars are left out."""
    m = mesh.sizes.get("model", 1)
    if m == 1:
        return 0.0
    rules = dict(Layout(cfg.layout).rules)
    act = cfg.batch // math.prod(mesh.sizes[a] for a in rules.get("batch", ()))
    act *= cfg.length * cfg.d_model * BYTES
    count = 2 * cfg.layers + (1 if "vocab" in rules else 0)
    return count * 2 * (m - 1) / m * act


def case(name: str) -> dict:
    """The figures of one config (keys: METRICS), planned on an abstract mesh."""
    cfg = catalog.get(name)
    mesh = Mesh(dict(cfg.mesh), devices="abstract")
    params = transformer.abstract(transformer.lm_shapes(cfg))
    batch = objectives.abstract_batch("lm", cfg.batch, cfg.length)
    loss = lambda p, b: transformer.lm_loss(p, b, cfg)
    r = lower(loss, mesh, cfg.layout).report(params, batch, wrt=0, show=False)
    train_flops, train_bytes = r.flops + r.backward_flops, r.bytes + r.backward_bytes
    out = {
        "parameters (billions)": sum(math.prod(t.shape) for t in _tensors(params)) / 1e9,
        "parameter bytes per device": param_bytes(cfg, mesh),
        "forward flops per device": r.flops,
        "training-step flops per device (forward + backward)": train_flops,
        "forward collective bytes per device": r.bytes,
        "training-step collective bytes per device (forward + backward)": train_bytes,
        "forward peak memory per device (estimate)": float(r.peak_memory),
        "_minimum": forward_minimum(cfg, mesh),
    }
    for hw, h in HARDWARE.items():
        seconds = train_flops / h["peak_flops"] + train_bytes / h["link_bytes_per_s"]
        out[f"predicted step seconds, {hw} (estimate)"] = seconds
    return out


def rows(names=CONFIGS) -> list[dict]:
    """One row per (config, metric), with the keys of benchmarks.report.FIELDS; `minimum` is
    the hand analysis of the forward collective bytes (other metrics have none)."""
    out = []
    for name in names:
        cfg, figures = catalog.get(name), case(name)
        for metric in METRICS:
            value = figures[metric]
            minimum = (
                figures["_minimum"] if metric == "forward collective bytes per device" else None
            )
            out.append(
                report.row("paper_scale", name, cfg.layout, mesh_text(cfg), metric, value,
                           minimum=minimum)
            )  # fmt: skip
    return out


def _si(v: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {prefix}{unit}"
    return f"{v:.0f} {unit}".rstrip()


def _table(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        by.setdefault(r["case"], {"cfg": r})[r["metric"]] = r
    head = ["config", "mesh (cores)", "layout", "params (B) ours / t2t", "param bytes/dev",
            "fwd flops/dev", "step flops/dev", "fwd coll. bytes/dev (/hand)",
            "step coll. bytes/dev", "fwd peak mem/dev (est.)",
            *(f"step s {hw} (est.)" for hw in HARDWARE), "t2t log-ppl/token"]  # fmt: skip
    body = []
    for name, m in by.items():
        cfg = catalog.get(name)
        v = lambda metric, m=m: m[metric]["namedmesh"]
        fwd = m["forward collective bytes per device"]
        ratio = f" ({fwd['ratio_to_min']:.3f})" if fwd["ratio_to_min"] else " (hand: 0)"
        body.append(
            [f"`{name}`", f"{m['cfg']['mesh']} ({math.prod(n for _, n in cfg.mesh)})",
             f"`{m['cfg']['layout']}`",
             f"{v('parameters (billions)'):.3f} / {config.PAPER_PARAMS[_size(name)]:.2f}",
             _si(v("parameter bytes per device"), "B"), _si(v("forward flops per device")),
             _si(v("training-step flops per device (forward + backward)")),
             _si(fwd["namedmesh"], "B") + ratio,
             _si(v("training-step collective bytes per device (forward + backward)"), "B"),
             _si(v("forward peak memory per device (estimate)"), "B"),
             *(f"{v(f'predicted step seconds, {hw} (estimate)'):.3f}" for hw in HARDWARE),
             f"{T2T_LOG_PPL[_size(name)]:.3f}"]
        )  # fmt: skip
    return report.md_table(head, body)


def write_docs(path: Path, rows: list[dict], command: str) -> None:
    """Write (or replace) the SECTION of the markdown file at `path` from `rows`."""
    hw = "\n".join(
        f"- **{k} core**: peak {h['peak_flops'] / 1e12:.2f} TFLOPS bf16, collective "
        f"bandwidth {h['link_bytes_per_s'] / 1e9:.0f} GB/s sent per core. Source: "
        f"{h['source']}."
        for k, h in HARDWARE.items()
    )
    text = f"""{SECTION}

Made by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC,
without devices: each model's loss is traced, planned and costed on an abstract mesh of the
paper's shape (`Mesh(sizes, devices="abstract")`, `lower(loss, mesh, layout).report`), in
well under a second per model. The configs are tensor2tensor's `mtf_transformer_paper_lm_*`
(d_model 1024, d_kv 256, 6 layers, heads 8·2^k, d_ff 8192·2^k, vocab 32768, batch 256 ×
length 256, unshared softmax) with their mesh shapes, 32 to 512 cores.

{_table(rows)}

Per device and per step; B = bytes, k/M/G/T = 10^3/10^6/10^9/10^12; "est." marks
estimates. Method:

- **Forward flops, collective bytes and peak memory** are the cost model's, for the
  forward pass (the loss) alone, with float32 parameters and activations. Collective
  bytes are bytes one device sends, as ring algorithms (all-reduce 2(n-1)/n of the
  buffer). "/hand" is the ratio to the paper's hand analysis: with heads and d_ff split
  over `model`, 2 activation all-reduces (batch, length, d_model) per layer plus one for
  the vocab-split embedding lookup; the remainder is the loss's per-position scalars.
  The data-parallel models send only the loss mean's scalars in the forward pass.
  Peak memory is the forward pass's (inputs + the most live values at once); training
  also holds the activations kept for the backward, gradients and optimizer state.
- **Training-step flops and collective bytes** are planned too: `report(wrt=0)` adds
  the backward pass as jax transposes the plan (each einsum's flops again for each
  differentiated input; Megatron's activation all-reduces come back as the psums of
  the replicated inputs' gradients; the data-parallel gradient all-reduce of every
  device's parameter shards is the transpose of their casts to varying). On simulated
  devices these equal the compiled `value_and_grad` in every benchmark row (the cost
  model section); optimizer flops are left out.
- **Predicted step seconds** = step flops / peak + step collective bytes / bandwidth:
  no overlap of compute and communication, compute at peak, no latency. It is a
  model, not a measurement; with bfloat16 activations, as the paper ran them, the
  activation traffic would be half.

Hardware assumptions (per TensorCore; a ring along one mesh axis of a 2-D torus uses 2
of a chip's 4 ICI ports, shared by the chip's 2 cores, so a core sends at about one
port's rate):

{hw}

Published numbers beside ours: the parameter counts and the per-token log-perplexity
after {T2T_STEPS:,} steps (10 epochs) are tensor2tensor's, from the docstring of
`mtf_transformer_paper_lm` (tensorflow/tensor2tensor,
`tensor2tensor/models/mtf_transformer.py`); our parameter counts agree with them to the
two digits given. **The paper's published step times or throughput (arXiv 1811.02084,
its LM1B table) could not be found in the stored sources searched (the paper's pages
there are stored only in part, and tensor2tensor's configs and docstrings give
parameters, steps and perplexity but no step time), so no measured step time is set
beside the predictions, and none is invented.** Which TPU generation the paper's runs
used is likewise not confirmed here, so both are shown; a 512-core mesh is a whole
TPUv2 pod (256 chips) or a quarter of a TPUv3 pod (1024 chips).
"""
    report.write_section(path, SECTION, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    ap.add_argument("--docs", type=Path, help="write the section into this markdown file")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    out = rows()
    print(_table(out))
    if args.docs:
        write_docs(args.docs, out, report.command("benchmarks.paper", argv))
        print(f"wrote {SECTION!r} in {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
