"""`python -m benchmarks.decode_latent [--positions 1024] [--prompt 64] [--new 64]
[--batches 1,8] [--rounds 3] [--docs docs/benchmarks.md]`: latent attention's KV cache
in the decoding benchmark (benchmarks/decode.py's method, its own section).

A DeepSeek-V3 of dense layers built by transformers from a config (random weights),
saved and loaded with `models.io.hub.load`. Its cache's bytes per token (every layer, the
compute dtype) are read off the Decoder's cache arrays and set against a full key/value
cache of the same model (every head's key, nope + rotated dims, and value), which
multi-head attention would keep; then, per batch size, greedy decoding of `--new`
tokens after `--prompt` random tokens: namedmesh's `Decoder.decode` against
transformers' `generate` (whose DeepSeek cache holds the latents too), single-threaded,
CPU time, alternated (benchmarks/fair.py); the share of equal tokens beside.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from benchmarks import cli, decode, fair, report

SECTION = "## Decoding: latent attention's cache (DeepSeek-V3)"


def build(args, folder: str):
    """The transformers DeepSeek-V3 (saved to `folder`) and the zoo's Decoder of it."""
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads,
        intermediate_size=args.d_ff, first_k_dense_replace=args.layers,
        q_lora_rank=args.q_rank, kv_lora_rank=args.kv_rank, qk_rope_head_dim=args.rope,
        qk_nope_head_dim=args.nope, v_head_dim=args.v, max_position_embeddings=args.positions,
        num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return decode.saved_pair(
        transformers.DeepseekV3ForCausalLM, cfg, folder, slots=args.prompt + args.new
    )


def bytes_per_token(dec, args) -> tuple[int, int]:
    """(the latent cache's bytes per token, a full key/value cache's) over every layer."""
    n = min(8, dec.slots)  # a prompt the cache holds, whatever --prompt and --new
    _, cache = dec.prefill_logits(np.ones((1, n), np.int32), np.array([n]))
    entries = [t for layer in cache for t in layer.values()]  # one dict per layer
    latent = sum(t.data.nbytes for t in entries) // entries[0].size_of("memory")
    itemsize = entries[0].data.dtype.itemsize
    full = args.layers * args.heads * (args.nope + args.rope + args.v) * itemsize
    return latent, full


def cache_table(sizes: tuple[int, int]) -> list[str]:
    latent, full = sizes
    return [
        "| cache | bytes per token | vs full KV |", "|---|---|---|",
        f"| latent (normed kv latent + shared rotated key) | {latent} | {latent / full:.3f} |",
        f"| full keys and values of every head | {full} | 1 |",
    ]  # fmt: skip


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=cli.count, default=1024, help="the model's positions")
    p.add_argument("--layers", type=cli.count, default=4)
    p.add_argument("--d-model", type=cli.count, default=256)
    p.add_argument("--heads", type=cli.count, default=8)
    p.add_argument("--d-ff", type=cli.count, default=688)
    p.add_argument("--q-rank", type=cli.count, default=96, help="q_lora_rank")
    p.add_argument("--kv-rank", type=cli.count, default=64, help="kv_lora_rank")
    p.add_argument("--rope", type=cli.count, default=32, help="qk_rope_head_dim")
    p.add_argument("--nope", type=cli.count, default=64, help="qk_nope_head_dim")
    p.add_argument("--v", type=cli.count, default=64, help="v_head_dim")
    p.add_argument("--vocab", type=cli.count, default=4096)
    p.add_argument("--prompt", type=cli.count, default=64, help="prompt tokens per row")
    p.add_argument("--new", type=cli.count, default=64, help="greedy tokens per row")
    p.add_argument("--batches", type=cli.counts, default=[1, 8], help="batch sizes")
    p.add_argument("--rounds", type=cli.count, default=3, help="timed rounds (min and median)")
    p.add_argument("--docs", default=None, help="replace this section of a markdown file")
    args = p.parse_args(argv)
    args.compile = False  # decode.measure's sides: namedmesh and eager generate
    threads = fair.single_threaded()  # before jax's first computation
    model, dec = build(args, tempfile.mkdtemp())
    sizes = bytes_per_token(dec, args)
    before = fair.load()
    results = {}
    for batch in args.batches:
        results[batch] = decode.measure(model, dec, batch, args)
        print(decode.table({batch: results[batch]})[-1], flush=True)
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    text = [
        SECTION, "",
        f"Made by `{report.command('benchmarks.decode_latent', argv or sys.argv[1:])}`.", "",
        f"A DeepSeek-V3 of {args.layers} dense layers, d_model {args.d_model}, {args.heads} "
        f"heads, q_lora_rank {args.q_rank}, kv_lora_rank {args.kv_rank}, qk_rope_head_dim "
        f"{args.rope}, qk_nope_head_dim {args.nope}, v_head_dim {args.v}, d_ff {args.d_ff}, "
        f"vocab {args.vocab} (random weights); float32 caches. Prompts of {args.prompt} "
        f"tokens, {args.new} greedy tokens per row, seconds per whole decode (prefill "
        f"included). {method} ({threads})", "",
        *cache_table(sizes), "", *decode.table(results),
    ]  # fmt: skip
    print("\n".join(text))
    if args.docs:
        report.write_section(args.docs, SECTION, "\n".join(text) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(cli.run(main))
