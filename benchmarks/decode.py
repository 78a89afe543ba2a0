"""`python -m benchmarks.decode [--config small] [--prompt 64] [--new 32] [--repeats 5]
[--docs docs/benchmarks.md]`: decoding speed of the zoo's LM on one device.

For batch 1 and 8, interleaved in one run and after a compile: prefill tokens/s (one
forward pass over the prompts that fills the KV cache, `Decoder.prefill`), decode
tokens/s (greedy steps of one token per row with the cache, as `Decoder.decode` runs
them: step, choose, the tokens back to the host), and the time of prefilling token by
token (`Decoder.prefill_by_steps`, how decoding prefilled before) over the one-pass
prefill. Medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import numpy as np

from models import config, transformer
from models.generate import Decoder

SECTION = "## Decoding: prefill and per-token speed"


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(dec: Decoder, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """Seconds of one-pass prefill, token-by-token prefill and `new` decode steps."""
    rows = np.random.default_rng(batch).integers(0, dec.cfg.vocab, (batch, prompt))
    lengths = np.full(batch, prompt)
    first = jax.random.key(0)

    def steps():
        logits, cache = dec.prefill_logits(rows, lengths)
        jax.block_until_ready(logits)
        start = time.perf_counter()
        for i in range(new):  # what Decoder.decode does per token
            tok = np.asarray(dec._choose(logits, jax.random.fold_in(first, i), None))
            logits, cache = dec.step_logits(tok, np.full(batch, prompt + i), cache)
        jax.block_until_ready(logits)
        return time.perf_counter() - start

    steps()  # compiles prefill, step and choose
    dec.prefill_by_steps(rows[:, :2])
    one_pass = _median_s(lambda: dec.prefill_logits(rows, lengths)[0], repeats)
    by_steps = _median_s(lambda: dec.prefill_by_steps(rows)[0], repeats)
    decode = statistics.median(steps() for _ in range(repeats))
    return {"one_pass": one_pass, "by_steps": by_steps, "decode": decode}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="small", help="the LM's config (models/config.py)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=32, help="decoded tokens per row")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median is shown")
    p.add_argument("--batches", default="1,8", help="batch sizes")
    p.add_argument("--docs", default=None, help="append the table to this markdown file")
    args = p.parse_args(argv)
    cfg = config.get(args.config, vocab=256)
    dec = Decoder(transformer.init(transformer.lm_shapes(cfg), 0), cfg)
    lines = [
        "| batch | prefill tokens/s (one pass) | decode tokens/s | token-by-token "
        "prefill tokens/s | token-by-token / one-pass prefill time |",
        "|---|---|---|---|---|",
    ]
    for batch in map(int, args.batches.split(",")):
        t = measure(dec, batch, args.prompt, args.new, args.repeats)
        n = batch * args.prompt
        lines.append(
            f"| {batch} | {n / t['one_pass']:,.0f} | {batch * args.new / t['decode']:,.0f} | "
            f"{n / t['by_steps']:,.0f} | {t['by_steps'] / t['one_pass']:.1f} |"
        )
        print(lines[-1], flush=True)
    if args.docs:
        with open(args.docs, "a") as f:
            f.write("\n" + "\n".join([SECTION, "", *lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
