"""`python -m benchmarks.experts_slots`: the dropless experts' kernel
(namedmesh/grouped_slots.py: the rows sorted by group, one loop of blocks, the whole
FFN a block; until 2026-12-06 batched matmuls of slots too, when each group fit in an
even share and some slack) against transformers, in one process by
benchmarks/fair.py's method (single-threaded, CPU time, alternated), so that a loaded
machine slows every side alike:

- the experts' FFN (benchmarks/experts_vs_hf.py's sizes and sides: an even random
  load) by the row-loop kernel alone (before: `ffn_rows` of `grouped_rows`, which the
  expert-parallel route still runs), by the blocked kernel (after) and by transformers'
  default experts path;
- Mixtral's training step at the honest tables' small and realistic sizes (benchmarks/
  train_vs_torch.py; its routers load experts unevenly) compiled with each kernel, and
  transformers' eager step;

and each program's compile (lower and compile, CPU seconds) and XLA's temporaries
(memory_analysis). Every side's output (or first loss) is checked against the others'
first.

With `--uneven`, the FFN's tokens choose their experts as unevenly as Mixtral's routers
do in the step (`MIXTRAL_LOAD`; a kernel before 2026-12-06 ran its loop there, not its
slots).

With `--before REF` (a git revision), the kernel as committed at REF
(namedmesh/grouped_slots.py read by `git show`) takes the loops' place: the same
tables of a change to the kernel against the kernel before it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import subprocess
import sys
import tempfile
import time
from unittest import mock

import numpy as np

from benchmarks import cli, fair


def loop_kernel():
    """A context in which `nm.grouped_ffn` traces to the row-loop kernel (before)."""
    from namedmesh.grouped import grouped_rows

    module = sys.modules["namedmesh.grouped_ffn"]
    loops = lambda act, x, g, wi, wo, wg: module.ffn_rows(grouped_rows, act, x, g, wi, wo, wg)  # noqa: E731
    return mock.patch.object(module, "blocked_ffn", loops)


def kernel_at(ref: str):
    """A context in which `nm.grouped_ffn` traces to namedmesh/grouped_slots.py as
    committed at git revision `ref`."""
    text = subprocess.run(["git", "show", f"{ref}:namedmesh/grouped_slots.py"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    path.write(text)
    path.close()
    spec = importlib.util.spec_from_file_location(f"grouped_slots_at_{ref}", path.name)
    kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernel)
    module = sys.modules["namedmesh.grouped_ffn"]
    # the kernel's entry was `slotted_ffn` until its slots were dropped (2026-12-06)
    entry = getattr(kernel, "blocked_ffn", None) or kernel.slotted_ffn
    return lambda: mock.patch.object(module, "blocked_ffn", entry)


KERNELS = {"loops (before)": loop_kernel, "blocks (after)": contextlib.nullcontext}


def kernels():
    return KERNELS


def compiled(fn, *args):
    """(fn compiled for args, its lower and compile in CPU seconds, XLA's temporaries in
    MB: memory_analysis's temp size)."""
    start = time.process_time()
    program = fn.lower(*args).compile()
    seconds = time.process_time() - start
    return program, seconds, program.memory_analysis().temp_size_in_bytes / 1e6


# one layer's rows per expert in Mixtral's realistic step at init (docs/benchmarks.md,
# "MoE experts' path"): the busiest expert gets 946 of 4096 where 584 slots fit
MIXTRAL_LOAD = (370, 308, 946, 796, 557, 522, 267, 330)


def uneven_choices(tokens: int, seed: int = 0) -> np.ndarray:
    """(tokens, 2) distinct experts per token, each drawn in proportion to MIXTRAL_LOAD."""
    rng = np.random.default_rng(seed)
    p = np.array(MIXTRAL_LOAD) / sum(MIXTRAL_LOAD)
    return np.stack([rng.choice(len(p), 2, replace=False, p=p) for _ in range(tokens)])


def experts_rows(sizes: dict, rounds: int, uneven: bool = False) -> tuple[dict, dict]:
    """({size: {side: seconds per round}}, {size: {kernel: (compile s, temporaries MB)}})
    of the experts' FFN, forward and backward; with `uneven`, Mixtral's load."""
    from benchmarks import experts_vs_hf as ev

    out, programs = {}, {}
    for label, (tokens, d, f) in sizes.items():
        a = ev.inputs(tokens, d, f)
        if uneven:
            a["choice"] = uneven_choices(tokens).astype(a["choice"].dtype)
        sides, want, programs[label] = {}, None, {}
        for name, context in kernels().items():
            with context():
                forward, both, args = ev.namedmesh_programs(a)
                got = np.asarray(forward(*args))
                program, seconds, temp = compiled(both, *args)
            programs[label][name] = (seconds, temp)
            want = got if want is None else want
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
            sides[f"namedmesh {name}"] = functools.partial(ev.jax_ready_call, program, args)
        experts, impl = ev.transformers_experts(a, None)
        forward, both = ev.torch_side(a, experts)
        np.testing.assert_allclose(forward(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        sides[f"transformers {impl}"] = both
        out[label] = fair.alternate(sides, rounds)
    return out, programs


def step_rows(size_names: list[str], rounds: int) -> tuple[dict, dict]:
    """({step: {side: seconds per round}}, {step: {kernel: (compile s, temporaries MB)}})
    of Mixtral's training step at each of `size_names`."""
    from benchmarks import step_movement, train_vs_torch, zoo_families

    out, programs = {}, {}
    for size_name in size_names:
        size = train_vs_torch.SIZES[size_name]
        spec = zoo_families.configs(size.layers, size.d_model, size.heads, size.vocab,
                                    size.length)["mixtral"]  # fmt: skip
        ids = np.random.default_rng(0).integers(0, size.vocab, (size.batch, size.length + 1))
        ids = ids.astype(np.int32)
        model, loaded, batch, decodes = zoo_families.built("mixtral", spec, ids[:, :-1])
        sides, losses, label = {}, {}, f"mixtral, {size}"
        programs[label] = {}
        for name, context in kernels().items():
            with context():
                start = time.process_time()
                program, state, _ = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
                seconds = time.process_time() - start
            temp = program.memory_analysis().temp_size_in_bytes / 1e6
            programs[label][name] = (seconds, temp)
            sides[f"namedmesh {name}"], losses[name] = step_movement.timed(program, state)
        torch_step = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes,
                                              compile=False)["PyTorch eager"][1]  # fmt: skip
        want = torch_step()
        for name, got in losses.items():
            if abs(got - want) > zoo_families.TOLERANCE * max(1.0, abs(want)):
                raise SystemExit(f"mixtral, {name}: first loss {got} differs from PyTorch's {want}")
        sides["PyTorch eager"] = torch_step
        out[label] = fair.alternate(sides, rounds)
    return out, programs


def programs_table(programs: dict, first: str) -> list[str]:
    """Markdown: per row, each kernel's compile CPU seconds and XLA's temporaries."""
    names = list(next(iter(programs.values())))
    head = [first, *(f"{n}: compile CPU s / temporaries MB" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, kernels_ in programs.items():
        cells = [f"{s:.2f} / {t:.0f}" for s, t in kernels_.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def table(rows: dict, first: str, unit: str) -> list[str]:
    """Markdown: per row, each side's min / median, and each side over the last one."""
    names = list(next(iter(rows.values())))
    head = [first, *(f"{n} {unit}" for n in names), *(f"{n} / {names[-1]}" for n in names[:-1])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    scale = 1e3 if unit == "ms" else 1.0
    for label, times in rows.items():
        base = fair.min_median(times[names[-1]])
        cells = [fair.cell(times[n], scale) for n in names]
        ratios = [
            f"{min(times[n]) / base[0]:.2f} / {fair.min_median(times[n])[1] / base[1]:.2f}"
            for n in names[:-1]
        ]
        lines.append(f"| {label} | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--rounds", type=cli.count, default=5)
    p.add_argument("--steps", type=cli.names, default=["small", "realistic"],
                   help="Mixtral's training step at these sizes")  # fmt: skip
    p.add_argument("--no-step", action="store_true", help="the experts' FFN tables only")
    p.add_argument("--no-ffn", action="store_true", help="the training steps only")
    p.add_argument("--uneven", action="store_true", help="the FFN under Mixtral's load")
    p.add_argument("--before", metavar="REF", help="the kernel at git revision REF "
                   "in the loops' place")  # fmt: skip
    args = p.parse_args(argv)
    if args.before:
        try:
            before_kernel = kernel_at(args.before)
        except subprocess.CalledProcessError as e:
            p.error(f"--before {args.before}: {e.stderr.strip().splitlines()[-1]}")
        KERNELS.clear()
        KERNELS.update({f"kernel at {args.before}": before_kernel,
                        "kernel (this tree)": contextlib.nullcontext})  # fmt: skip
    threads = fair.single_threaded()
    from benchmarks import honest, stack

    before = fair.load()
    print(stack.describe() + "\n", flush=True)
    if not args.no_ffn:
        rows, programs = experts_rows(honest.EXPERT_SIZES, args.rounds, args.uneven)
        lines = table(rows, "size (8 experts, top 2)", "ms") + [""]
        lines += programs_table(programs, "FFN's gradient program") + [""]
        print("\n".join(lines), flush=True)  # the steps take minutes more
    if not args.no_step:
        rows, programs = step_rows(args.steps, args.rounds)
        lines = table(rows, "training step", "s") + [""]
        print("\n".join(lines + programs_table(programs, "training step's program")))
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    print("\n" + method + f" ({threads})")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
