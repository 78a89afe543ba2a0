"""`python -m benchmarks.einsum_emission [--families llama,gpt2] [--repeats 5]`: each
family's training step (benchmarks/zoo_families.py's model, batch and AdamW step) with
the einsum primitive's jax implementation as `jnp.einsum` and jax's own gradient (the
emission before namedmesh/contract.py) against the current one and PyTorch eager,
alternated in one process by benchmarks/fair.py's method."""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from benchmarks import cli, fair


def _jnp_einsum(*xs, out, in_dims, preferred=None, precision=None):
    from namedmesh.einsum import spec

    return jnp.einsum(
        spec(in_dims, out), *xs, preferred_element_type=preferred, precision=precision
    )


def _zoo_step(loaded, batch, targets, impl=None):
    """zoo_families' jitted training step, traced (at its first call, inside zoo_sides)
    with the einsum primitive's jax implementation `impl` (None: the current one)."""
    from benchmarks import zoo_families
    from lowering.rules import P

    kept = P.einsum.jax_impl
    P.einsum.jax_impl = impl or kept
    try:
        return zoo_families.zoo_sides(loaded, batch, targets)[1]
    finally:
        P.einsum.jax_impl = kept


def row(name: str, spec: tuple, ids, targets, repeats: int) -> str:
    """One family's markdown row: before and after ms and ratios to PyTorch eager."""
    from benchmarks import zoo_families

    model, loaded, batch, decodes = zoo_families.built(name, spec, ids)
    sides = {
        "before": _zoo_step(loaded, batch, targets, _jnp_einsum),
        "after": _zoo_step(loaded, batch, targets),
        "torch": zoo_families.torch_sides(model, ids, targets, decodes, False)["PyTorch eager"][1],
    }
    t = fair.alternate(sides, repeats)
    cells = [name]
    for side in ("before", "after"):
        cells += [fair.cell(t[side]), fair.ratio(t[side], t["torch"])]
    cells += [fair.cell(t["torch"]), f"{min(t['after']) / min(t['before']):.2f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None, help="comma-separated (default: all)")
    p.add_argument("--repeats", type=cli.count, default=5)
    args = p.parse_args(argv)
    threads = fair.single_threaded()
    from benchmarks import zoo_families
    from models.io import hub

    specs = zoo_families.configs(2, 256, 8, 8192, 128)
    names = args.families.split(",") if args.families else list(hub.FAMILIES)
    rng = np.random.default_rng(0)
    ids = rng.integers(2, 8192, (4, 128)).astype(np.int32)
    targets = rng.integers(2, 8192, (4, 128)).astype(np.int32)
    print(f"{threads}; load {fair.load()}")
    head = ["family", "before ms", "before / PyTorch", "after ms", "after / PyTorch",
            "PyTorch eager ms", "after / before"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in names:
        print(row(name, specs[name], ids, targets, args.repeats), flush=True)
    print(f"load {fair.load()}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
