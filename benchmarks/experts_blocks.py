"""`python -m benchmarks.experts_blocks`: the rate of each of the experts' kernel's dots
(namedmesh/grouped_slots.py's loop) by the size of its row blocks, at the realistic
size's shapes (issue 40 lead (c): which block sizes the loop should use):

    python -m benchmarks.experts_blocks --rows 4096 --d-model 512 --d-ff 1024 --rounds 5

For each product of the FFN's forward and backward pass (`PRODUCTS`: a block's rows
times a weight, or a weight gradient summed over the rows), XLA covers `--rows` rows
by blocks of r rows as the kernel does (a loop, each block a dynamic slice of the rows,
its product written into the rows' result or added to the weight gradient in float32),
and PyTorch (MKL) by `torch.mm` of each block's slice, as transformers' `grouped_mm`
runs one per expert; both single-threaded, CPU time, alternated (benchmarks/fair.py).
Every side's result is checked against NumPy's float64 product first. Prints GFLOP/s
per product and block size, a markdown table.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks import cli, fair

# name -> einsum of a block's rows (n) with a weight, or of two blocks' rows (a weight
# gradient, summed over the blocks); c: the model's width, f: the hidden layer's
PRODUCTS = {
    "x wi (forward)": "nc,cf->nf",
    "h wo (forward)": "nf,fc->nc",
    "dy wo^T (backward)": "nc,fc->nf",
    "dh wi^T (backward)": "nf,cf->nc",
    "x^T dh: wi's gradient": "nc,nf->cf",
    "h^T dy: wo's gradient": "nf,nc->fc",
}


def operands(spec: str, rows: int, c: int, f: int, seed: int = 0):
    size = {"n": rows, "c": c, "f": f}
    rng = np.random.default_rng(seed)
    ins = spec.split("->")[0].split(",")
    return tuple(rng.standard_normal([size[d] for d in s]).astype(np.float32) for s in ins)


def summed(spec: str) -> bool:
    """Whether the product sums over the rows (a weight gradient: added up over blocks)."""
    return "n" not in spec.split("->")[1]


def xla_side(spec: str, block: int, a, b):
    """The product over all rows by a loop of `block`-row blocks, as the kernel runs it."""
    import jax
    import jax.numpy as jnp

    rows, out = a.shape[0], spec.split("->")[1]
    size = dict(zip(spec.split("->")[0].replace(",", ""), (*a.shape, *b.shape), strict=True))

    def run(a, b):
        def body(i, acc):
            at = jax.lax.dynamic_slice_in_dim(a, i * block, block)
            if summed(spec):
                bt = jax.lax.dynamic_slice_in_dim(b, i * block, block)
                return acc + jnp.einsum(spec, at, bt, preferred_element_type=jnp.float32)
            y = jnp.einsum(spec, at, b, preferred_element_type=jnp.float32)
            return jax.lax.dynamic_update_slice_in_dim(acc, y, i * block, 0)

        acc = jnp.zeros([size[d] for d in out], jnp.float32)
        return jax.lax.fori_loop(0, rows // block, body, acc)

    program = jax.jit(run).lower(a, b).compile()
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    return lambda: np.asarray(program(ja, jb).block_until_ready())


def torch_side(spec: str, block: int, a, b):
    """The product over all rows by `torch.mm` of each block's slice (MKL)."""
    import torch

    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    mm = {"nc,cf->nf": lambda x, w: x @ w, "nf,fc->nc": lambda x, w: x @ w,
          "nc,fc->nf": lambda x, w: x @ w.T, "nf,cf->nc": lambda x, w: x @ w.T,
          "nc,nf->cf": lambda x, g: x.T @ g, "nf,nc->fc": lambda x, g: x.T @ g}[spec]  # fmt: skip

    def run():
        if summed(spec):
            out = None
            for i in range(0, a.shape[0], block):
                y = mm(ta[i : i + block], tb[i : i + block])
                out = y if out is None else out.add_(y)
            return out.numpy()
        return torch.cat([mm(ta[i : i + block], tb) for i in range(0, a.shape[0], block)]).numpy()

    return run


def rates(rows: int, c: int, f: int, blocks: list[int], rounds: int) -> dict:
    """{product: {side: GFLOP/s by its min time}}, each side checked against NumPy."""
    out = {}
    for name, spec in PRODUCTS.items():
        a, b = operands(spec, rows, c, f)
        want = np.einsum(spec, a.astype(np.float64), b.astype(np.float64))
        sides = {}
        for block in blocks:
            sides[f"XLA {block}"] = xla_side(spec, block, a, b)
            sides[f"MKL {block}"] = torch_side(spec, block, a, b)
        for side, run in sides.items():
            np.testing.assert_allclose(run(), want, rtol=1e-3, atol=1e-3 * np.abs(want).max(),
                                       err_msg=f"{name}, {side}")  # fmt: skip
        flops = 2 * rows * c * f
        out[name] = {s: flops / min(t) / 1e9 for s, t in fair.alternate(sides, rounds).items()}
        print(name, {s: round(r) for s, r in out[name].items()}, file=sys.stderr, flush=True)
    return out


def table(out: dict, blocks: list[int]) -> list[str]:
    head = ["product", *(f"XLA / MKL, {b} rows" for b in blocks)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in out.items():
        cells = [f"{r[f'XLA {b}']:.0f} / {r[f'MKL {b}']:.0f}" for b in blocks]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__)
    p.add_argument("--rows", type=cli.count, default=4096, help="rows in all (a layer's)")
    p.add_argument("--d-model", type=cli.count, default=512)
    p.add_argument("--d-ff", type=cli.count, default=1024)
    p.add_argument("--blocks", type=cli.counts, default=[32, 64, 128, 256, 512, 1024, 4096])
    p.add_argument("--rounds", type=cli.count, default=5)
    args = p.parse_args(argv)
    for b in args.blocks:
        if args.rows % b:
            p.error(f"--blocks: {b} rows does not divide --rows {args.rows}")
    threads = fair.single_threaded()
    from benchmarks import stack

    before = fair.load()
    out = rates(args.rows, args.d_model, args.d_ff, args.blocks, args.rounds)
    print(stack.describe() + "\n")
    print(f"GFLOP/s, {args.rows} rows, d_model {args.d_model}, d_ff {args.d_ff}, by block:\n")
    print("\n".join(table(out, args.blocks)))
    print(f"\nSingle-threaded ({threads}), CPU time, alternated over {args.rounds} rounds; "
          f"load average {before} before, {fair.load()} after.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
