"""`python -m benchmarks.pad_skip [--rounds N] [--sizes tiny,wider] [--docs PATH]`: does an
uneven pipeline's pad cost layer work? Timed, not read off the HLO (as
tests/test_pipeline_uneven.py does).

On 8 simulated CPU devices (mesh stage=4 x data=2, layout `layers:stage;batch:data`), the
tiny LM's training step (loss and gradients) at each size of SIZES, with 5 layers, which
4 stages do not divide: each stage runs 2 layer slots, 8 in all, 3 of them pads
(namedmesh/uneven.py). Sides:
- **5 layers, pads skipped**: as shipped (a `jax.lax.cond` per slot, lowering/emit.py);
- **5 layers, pads computed**: the same program with the skip switched off. No public
  switch exists (the scan's `skip` param is set by `nm.scan` from its body being a
  `Masked`), so this side patches `lowering.emit._skipping` to return the body unchanged
  while the step is traced and compiled: the pads then run the layer and `Masked`'s
  `where` keeps the carry, the program's meaning as without lowering;
- **8 layers**: an even model with as many layers as slots (the pads' cost if computed);
- **4 layers**: one layer per stage, the pipeline's fixed costs plus 4 slots' work.

All 8 devices share the process's CPU and a device waiting on a collective sleeps, so
the CPU time is the sum of every stage's work: skipped pads should cost the 5-layer step
about the 4-layer step plus one slot ((8 layers - 4 layers) / 4), computed pads about
the 8-layer step. Timed by benchmarks/fair.py's method (one thread, `time.process_time`,
sides alternated, min and median); each side's compiled `conditional` count says which
program it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
from pathlib import Path
from unittest import mock

from benchmarks import cli, fair

HEADING = "### Uneven stages: pads skipped, measured"
AFTER = "## Pipelines: the LM's layers over a stage axis"  # the subsection closes it
MESH = {"stage": 4, "data": 2}
LAYOUT = "layers:stage;batch:data"
SIZES = {"tiny": (64, 32), "wider": (256, 128)}  # name -> (d_model, length)
SIDES = {  # name -> (layers, pads skipped)
    "5 layers, pads skipped": (5, True),
    "5 layers, pads computed": (5, False),
    "8 layers": (8, True),
    "4 layers": (4, True),
}


def compiled_step(layers: int, skip: bool, width: int = 64, length: int = 32):
    """(the compiled training step, its parameters, its HLO's conditional count, loss):
    the tiny LM at d_model `width` (d_ff 4x, d_kv 16), batch 16 x `length`."""
    import jax

    from benchmarks.long_seq import lm_batch
    from lowering import Mesh, emit, lower
    from models import catalog, transformer

    cfg = catalog.get("tiny").replace(
        layers=layers, length=length, batch=16, d_model=width, heads=width // 16, d_ff=4 * width
    )
    params = transformer.init(transformer.lm_shapes(cfg), 0)
    batch = lm_batch(cfg, cfg.length, cfg.batch)
    lowered = lower(lambda p, b: transformer.lm_loss(p, b, cfg), Mesh(MESH), LAYOUT)
    step = jax.jit(jax.value_and_grad(lambda p: lowered(p, batch).data))
    switch = mock.patch.object(emit, "_skipping", lambda body, ys: body)
    with contextlib.nullcontext() if skip else switch:  # traced and compiled under it
        compiled = step.lower(params).compile()
    conds = sum(" conditional(" in line for line in compiled.as_text().splitlines())
    loss = float(jax.block_until_ready(compiled(params))[0])
    return compiled, params, conds, loss


def measure(size: str, rounds: int) -> tuple[dict, dict, dict]:
    """At SIZES[size]: ({side: CPU seconds per round}, {side: conditionals}, {side: loss})."""
    import jax

    steps = {name: compiled_step(*how, *SIZES[size]) for name, how in SIDES.items()}
    calls = {n: (lambda c=c, p=p: jax.block_until_ready(c(p))) for n, (c, p, _, _) in steps.items()}
    times = fair.alternate(calls, rounds)
    return times, {n: s[2] for n, s in steps.items()}, {n: s[3] for n, s in steps.items()}


def rows(size: str, times: dict, conds: dict, losses: dict) -> list[list[str]]:
    base = times["8 layers"]
    return [[size if i == 0 else "", name, fair.cell(t), fair.ratio(t, base), str(conds[name]),
             f"{losses[name]:.5f}"] for i, (name, t) in enumerate(times.items())]  # fmt: skip


HEAD = ["size", "step", "CPU ms (min / median)", "/ 8 layers (min / median)", "conditionals",
        "loss"]  # fmt: skip


def saved(size: str, times: dict) -> str:
    """What skipping saved against what the 3 pads' slots cost, by min / by median: one
    slot is (8 layers - 4 layers) / 4; the skipped side's prediction 4 layers + one slot."""
    get = lambda name: fair.min_median(times[name])  # noqa: E731
    (e8, m8), (e4, m4) = get("8 layers"), get("4 layers")
    (sk, msk), (co, mco) = get("5 layers, pads skipped"), get("5 layers, pads computed")
    slot, mslot = (e8 - e4) / 4, (m8 - m4) / 4
    return (f"{size}: one layer slot (all 8 devices) {slot * 1e3:.4g} / {mslot * 1e3:.4g} ms; "
            f"skipping saved {(co - sk) * 1e3:.4g} / {(mco - msk) * 1e3:.4g} ms, "
            f"{(co - sk) / (3 * slot):.0%} / {(mco - msk) / (3 * mslot):.0%} of the 3 pads' "
            f"slots; skipped / predicted (4 layers + one slot) "
            f"{sk / (e4 + slot):.2f} / {msk / (m4 + mslot):.2f}")  # fmt: skip


def write_docs(path: Path, body: str) -> None:
    """Replace the subsection, or put it at the end of the pipelines section (before the
    next `## ` heading after AFTER)."""
    from benchmarks import report

    text = path.read_text(encoding="utf-8")
    if HEADING not in text.splitlines():
        lines = text.splitlines(keepends=True)
        start = next(i for i, ln in enumerate(lines) if ln.rstrip() == AFTER)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))  # fmt: skip
        text = "".join(lines[:end]) + HEADING + "\n\n" + "".join(lines[end:])
    path.write_text(report.replace_section(text, HEADING, body), encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=cli.count, default=5, help="timed rounds")
    p.add_argument("--sizes", type=cli.names, default=list(SIZES), help="of " + ",".join(SIZES))
    p.add_argument("--docs", default="", help="markdown file to write the subsection in")
    args = p.parse_args(argv)
    if unknown := [n for n in args.sizes if n not in SIZES]:
        p.error(f"--sizes: {', '.join(unknown)} unknown; the sizes are {', '.join(SIZES)}")
    flags = os.environ.get("XLA_FLAGS", "")
    if "jax" not in sys.modules and "device_count" not in flags:  # before jax starts
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    threads = fair.single_threaded()
    before = fair.load()
    cells, notes = [], []
    for size in args.sizes:
        times, conds, losses = measure(size, args.rounds)
        cells += rows(size, times, conds, losses)
        notes.append(saved(size, times))
    after = fair.load()
    from benchmarks import report

    result = "\n\n".join([report.md_table(HEAD, cells), "\n".join(f"- {n}" for n in notes)])
    print(result)
    print(f"({threads}; load {before} before, {after} after; {args.rounds} rounds)")
    if args.docs:
        when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
        write_docs(Path(args.docs), _section(result, when, threads, before, after, args))
        print(f"wrote {HEADING!r} in {args.docs}")
    return 0


WHAT_IT_SAYS = """\
What it says: the pads are skipped, yet skipping saves little time. Skipped they are: a
debug callback in the layer branch of the tiny 5-layer step's conditional (forward) ran
110 times, 5 real slots x 11 ticks (8 microbatches on 4 stages) x 2 data shards, not the
176 of 8 slots, and its loss equals the model's run by jax unlowered (6.16032). But the
computed-pads side costs about the 8-layer step (as expected: 8 slots of layer work),
and the skipped side about as much at the tiny size and little less at the wider one
(under a third of the 3 pads' slots saved in each run so far), far above the
prediction (the 4-layer step plus one slot).
A pad slot still pays what the stage's layer loop does around the conditional for every
slot, real or pad (read off the compiled HLO; not timed op by op): per tick, the slot's
weights and inputs sliced out of the stage's stacks and materialized as the
conditional's operands (a slice fuses into the ops that read it, not into a
conditional: the tiny step's forward loop body holds 100 slice fusions with the skip,
12 without, its backward 78 against 26), its residuals written into the [ticks, slots,
...] buffers, and in the backward pass its weight gradients added into the stage's
accumulators; at the tiny size these and the conditional's own dispatch outweigh the
layer work it skips. So issue 37's claim holds for the layer work and not for the step
time: a pad costs most of a slot. Making pads free needs the skip one level up (one
`jax.lax.switch` per tick on the stage's count of real layers, each branch a loop over
that many slots, so a pad has no slot at all); not built here.
"""


def _section(result, when, threads, before, after, args) -> str:
    sizes = "; ".join(f"{n}: d_model {w} (d_ff {4 * w}), length {n_}"
                      for n, (w, n_) in SIZES.items() if n in args.sizes)  # fmt: skip
    return f"""{HEADING}

Made by `python -m benchmarks.pad_skip --rounds {args.rounds} --docs docs/benchmarks.md`
on {when}: the LM above at two sizes ({sizes}; batch 16, vocab 256, float32), one
training step (loss and gradients), on 8 simulated CPU devices, mesh stage=4 x data=2,
layout `{LAYOUT}`. With 5 layers each stage runs 2 layer slots, 3 of the 8 pads.
Method: benchmarks/fair.py's, one thread ({threads}), CPU time, the sides alternated
over {args.rounds} rounds after a warm-up; load average (1/5/15 min) {before} before
and {after} after. All 8 devices share the one CPU and a device waiting on a collective
sleeps, so a step's CPU time is the sum of every stage's work. "Pads computed" is the
same 5-layer program with the skip switched off (`lowering.emit._skipping` patched to
return the layer body as it is while the step is traced and compiled: the benchmark's
own switch, no library flag); "conditionals" counts the compiled HLO's `conditional`
ops, the skip's (the two 5-layer sides' equal losses: the same program).

{result}

{WHAT_IT_SAYS}"""


if __name__ == "__main__":
    sys.exit(cli.run(main))
