"""`python -m benchmarks.step_profile`: where a zoo family's training step spends its
time beside the dots, both sides single-threaded (benchmarks/fair.py), at a size of
benchmarks/train_vs_torch.py, side by side (Mixtral's experts: their kernel's dots
with the matmuls, its other ops a bucket of their own, as transformers' `grouped_mm`
path's `mm` calls and its sort, histogram and index ops):

- namedmesh: the compiled step traced by `jax.profiler` (benchmarks/experts_profile.py's
  readers: each XLA:CPU thunk's self time, summed over `--rounds` steps), each op put in
  a bucket by its HLO kind, shape and jax op_name (`xla_bucket`);
- PyTorch: transformers' eager step under `torch.profiler`, each operator's self CPU
  time put in a bucket by its name (`torch_bucket`).

Prints one markdown table, ms per step under each profiler (both slow their side a
little; the ratio of the totals is the step's), then each side's top ops:

    python -m benchmarks.step_profile --family llama --size realistic
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

from benchmarks import cli, experts_profile, fair

BUCKETS = (
    "matmuls: projections, FFN, output layer",
    "attention (kernel: its dots, exps, masks, slices)",
    "rotary embedding (and q, k moved heads-first)",
    "loss: log-softmax over the vocabulary",
    "AdamW",
    "per-layer weights sliced out, gradients stacked back",
    "elementwise: norms, residual adds, SwiGLU, embedding",
    "copies, fills, casts, views",
    "MoE experts beside their dots: sort, gathers, masks, fills, weight-gradient adds",
)
EXPERTS = "grouped_ffn"  # namedmesh/grouped_slots.py's ops carry this scope (SCOPE)
EINSUM = re.compile(r"\w+,\w+->\w+")


def xla_bucket(name: str, meta: str, shape: str, heads_rows: int, vocab: int) -> str:
    """The bucket of one XLA op: `name` its HLO instruction, `meta` its metadata,
    `shape` its result's; `heads_rows` is batch x kv heads, the leading dim of every
    value inside the fused attention kernel (namedmesh/flash.py's (b kv, ...) blocks);
    a value with a last dim of `vocab` outside AdamW is the loss's."""
    op = (re.search(r'op_name="jit\(step\)/([^"]*)"', meta) or [None, ""])[1]
    lead = re.match(r"\w+\[(\d+)", shape)
    dot = name.startswith(("dot", "ynn_fusion")) and "dot_general" in op
    if EXPERTS in op:  # the experts' kernel: its dots are matmuls, as grouped_mm's are
        return BUCKETS[0] if dot else BUCKETS[8]
    if EINSUM.search(op) or "cond/branch" in op or (lead and int(lead[1]) == heads_rows):
        return BUCKETS[1]
    if dot:
        return BUCKETS[0]
    if "jvp" not in op and op:  # the optimizer runs outside the differentiated loss
        return BUCKETS[4]
    if "closed_call/concatenate" in op:
        return BUCKETS[2]
    if op in ("jvp()/slice", "transpose(jvp())/concatenate"):
        return BUCKETS[5]
    if re.search(rf",{vocab}\]", shape) or "reduce_max" in op:
        return BUCKETS[3]
    if name.startswith(("copy", "wrapped_broadcast", "bitcast_copy")):
        return BUCKETS[7]
    return BUCKETS[6]


ADAMW_OPS = ("Optimizer", "addcdiv_", "addcmul_", "lerp_", "aten::sqrt", "mul_", "add_")
ADAMW_OPS += ("aten::div",)
# transformers' grouped_mm experts beside their mm calls: the sort by expert, its
# histogram, the rows' gathers and the gradients' index_put
EXPERT_OPS = ("grouped_mm", "GroupedMm", "aten::index ", "index_put", "aten::histc", "aten::sort")
VIEWS = ("copy_", "fill_", "_to_copy", "aten::t ", "transpose", "view", "empty", "as_strided")
TORCH = (  # bucket -> words of operator names (first match), the rest elementwise
    (BUCKETS[8], EXPERT_OPS),
    (BUCKETS[0], ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "MmBackward")),
    (BUCKETS[1], ("scaled_dot_product", "aten::_softmax", "SoftmaxBackward")),
    (BUCKETS[2], ("aten::cat", "aten::neg")),
    (BUCKETS[3], ("log_softmax", "nll_loss", "LogSoftmax", "NllLoss")),
    # the in-place ops and the division are AdamW's (and Gemma 2's soft-caps' division)
    (BUCKETS[4], ADAMW_OPS),
    (BUCKETS[7], (*VIEWS, "detach", "reshape", "expand", "zeros")),
)


def torch_bucket(op: str) -> str:
    """The bucket of one PyTorch operator (`TORCH`; the in-place ops are AdamW's)."""
    for bucket, words in TORCH:
        if any(w in f"{op} " for w in words):  # "aten::t " is aten::t alone, not tanh
            return bucket
    return BUCKETS[6]


def shapes(hlo: str) -> dict[str, str]:
    """{instruction: its result's shape} of compiled HLO text."""
    found = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+)", hlo, re.M)
    return dict(found)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--family", default="llama")
    p.add_argument("--size", default="realistic", choices=("small", "realistic"))
    p.add_argument("--rounds", type=cli.count, default=2)
    p.add_argument("--top", type=cli.count, default=25)
    args = p.parse_args(argv)
    notes = fair.single_threaded()
    from benchmarks import step_movement, train_vs_torch, zoo_families

    size = train_vs_torch.SIZES[args.size]
    if args.family not in (known := train_vs_torch.families(size)):
        p.error(f"--family: no family {args.family!r} (known: {', '.join(sorted(known))})")
    ids, model, loaded, batch, decodes = train_vs_torch.case(args.family, size)
    compiled, state, _ = step_movement.compiled_step(loaded, batch, ids[:, 1:], {})
    run, _ = step_movement.timed(compiled, state)
    run()
    hlo = compiled.as_text()
    # a fusion named by its own line's metadata where it has some, else its first inside
    meta = experts_profile.fusion_callees(hlo) | experts_profile.metadata(hlo)
    shape = shapes(hlo)
    ours = experts_profile.jax_profile(compiled, state, args.rounds)
    ours = {k: v for k, v in ours.items() if k in meta}
    heads_rows = size.batch * max(1, size.heads // 2)  # zoo_families' kv heads
    torch_step = zoo_families.torch_sides(model, ids[:, :-1], ids[:, 1:], decodes,
                                          compile=False)["PyTorch eager"][1]  # fmt: skip
    torch_step()
    theirs = experts_profile.torch_profile(torch_step, args.rounds)
    mine, yours = collections.Counter(), collections.Counter()
    for k, ms in ours.items():
        mine[xla_bucket(k, meta[k], shape.get(k, ""), heads_rows, size.vocab)] += ms
    for k, ms in theirs.items():
        yours[torch_bucket(k)] += ms
    print(f"{args.family}'s training step, {size}; {notes}; load {fair.load()}")
    print("\n| where | namedmesh ms | PyTorch eager ms | namedmesh - PyTorch ms |")
    print("|---|---|---|---|")
    for b in BUCKETS:
        print(f"| {b} | {mine[b]:.1f} | {yours[b]:.1f} | {mine[b] - yours[b]:+.1f} |")
    a, t = sum(mine.values()), sum(yours.values())
    print(f"| total | {a:.1f} | {t:.1f} | {a - t:+.1f} |")
    print("\nnamedmesh's top ops: | ms | HLO op | shape | op_name | bucket |")
    for k, ms in sorted(ours.items(), key=lambda kv: -kv[1])[: args.top]:
        op = (re.search(r'op_name="jit\(step\)/([^"]*)"', meta[k]) or [None, ""])[1]
        print(f"| {ms:.1f} | {k} | {shape.get(k, '')} | {op} | "
              f"{xla_bucket(k, meta[k], shape.get(k, ''), heads_rows, size.vocab)} |")  # fmt: skip
    print("\nPyTorch's top operators: | ms | operator | bucket |")
    for k, ms in sorted(theirs.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {ms:.2f} | {k} | {torch_bucket(k)} |")
    return {"namedmesh": dict(mine), "PyTorch eager": dict(yours)}


if __name__ == "__main__":
    sys.exit(cli.run(main))
