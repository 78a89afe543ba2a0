"""`python -m benchmarks.experts_profile`: where Mixtral's training step spends its
time, both sides single-threaded (benchmarks/fair.py), at a size of
benchmarks/train_vs_torch.py (`--size realistic`):

- namedmesh: the compiled step traced by `jax.profiler` (XLA:CPU times each thunk: a
  fusion, a dot, a loop's body ops), each op's time summed over `--rounds` steps and
  put in a bucket by the jax operations its HLO metadata names (`BUCKETS`), and summed
  by HLO kind and jax op_name (the layers' copies of an op together);
- PyTorch: transformers' eager step under `torch.profiler`, its self CPU time per
  operator.

Prints both as markdown tables, ms per step."""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile

import numpy as np

from benchmarks import cli, fair

# bucket -> words of an op's HLO op_name that put it there, first match: the experts'
# kernel runs under its named scope (namedmesh/grouped_slots.py's SCOPE)
BUCKETS = (
    ("experts' kernel", ("grouped_ffn",)),
    ("top-k, sorts, scatters, gathers", ("top_k", "sort", "scatter", "gather")),
    ("AdamW", ("sqrt", "integer_pow")),
)


def bucket(meta: str) -> str:
    for name, words in BUCKETS:
        if any(w in meta for w in words):
            return name
    return "other"


def metadata(hlo: str) -> dict[str, str]:
    """{instruction name: its op_name and source file} of the compiled HLO text."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{([^}]*)\}", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def fusion_callees(hlo: str) -> dict[str, str]:
    """{fusion instruction: the metadata of the first instruction inside its computation
    that has some} (a fusion's own line often carries none)."""
    comps, current, out = {}, None, {}
    for line in hlo.splitlines():
        head = re.match(r"^%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = head.group(1)
        elif current and (m := re.search(r"metadata=\{([^}]*)\}", line)):
            comps.setdefault(current, m.group(1))
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*calls=%?([\w.\-]+)", line)
        if m and m.group(2) in comps:
            out[m.group(1)] = comps[m.group(2)]
    return out


def jax_profile(compiled, state, rounds: int) -> dict[str, float]:
    """{op name: ms per step} of `rounds` traced steps."""
    import jax

    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(rounds):
            state, value = compiled(state)
            value.block_until_ready()
    (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    return self_times([e for e in events if e.get("ph") == "X"], rounds)


def self_times(events: list, rounds: int) -> collections.Counter:
    """{name: ms per step} of trace events, each less the events nested in it on its
    thread (a loop's time is its body ops')."""
    total = collections.Counter()
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("pid"), e.get("tid")].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # (end, name)
        for e in evs:
            while stack and e["ts"] >= stack[-1][0] - 1e-3:
                stack.pop()
            if stack:
                total[stack[-1][1]] -= e["dur"] / 1e3 / rounds
            total[e["name"]] += e["dur"] / 1e3 / rounds
            stack.append((e["ts"] + e["dur"], e["name"]))
    return total


def torch_profile(step, rounds: int) -> dict[str, float]:
    """{operator: self CPU ms per step} of `rounds` eager steps."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            step()
    return {a.key: a.self_cpu_time_total / 1e3 / rounds for a in prof.key_averages()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--size", default="realistic", choices=("small", "realistic"))
    p.add_argument("--rounds", type=cli.count, default=2)
    p.add_argument("--top", type=cli.count, default=40)
    args = p.parse_args(argv)
    print(fair.single_threaded())
    from benchmarks import step_movement, train_vs_torch, zoo_families

    size = train_vs_torch.SIZES[args.size]
    spec = zoo_families.configs(size.layers, size.d_model, size.heads, size.vocab,
                                size.length)["mixtral"]  # fmt: skip
    ids = np.random.default_rng(0).integers(0, size.vocab, (size.batch, size.length + 1))
    ids = ids.astype(np.int32)
    model, loaded, batch, decodes = zoo_families.built("mixtral", spec, ids[:, :-1])
    compiled, state, _ = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
    run, _ = step_movement.timed(compiled, state)
    run()
    hlo = compiled.as_text()
    meta = metadata(hlo) | fusion_callees(hlo)
    ops = jax_profile(compiled, state, args.rounds)
    buckets = collections.Counter()
    for name, ms in ops.items():
        if name in meta or re.match(r"[\w\-]+(\.\d+)?$", name):
            buckets[bucket(meta.get(name, ""))] += ms
    print(f"namedmesh, mixtral {size}: ms per step by bucket, total {sum(buckets.values()):.1f}")
    for name, ms in buckets.most_common():
        print(f"| {name} | {ms:.1f} |")
    groups = collections.Counter()
    for name, ms in ops.items():
        if name in meta:
            kind = re.sub(r"[.\d]+$", "", name).split("_fusion")[0]
            where = re.search(r'op_name="jit\(step\)/([^"]*)"', meta[name])
            groups[f"{kind} {where.group(1) if where else ''}"] += ms
    print("\nby operation: | HLO kind, jax op_name | ms |")
    for name, ms in groups.most_common(args.top):
        print(f"| {name} | {ms:.1f} |")
    torch_step = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes,
                                          compile=False)["PyTorch eager"][1]  # fmt: skip
    torch_step()
    theirs = torch_profile(torch_step, args.rounds)
    print(f"\nPyTorch eager: self CPU ms per step, total {sum(theirs.values()):.1f}")
    for name, ms in sorted(theirs.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {name} | {ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
