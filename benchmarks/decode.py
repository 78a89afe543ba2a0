"""`python -m benchmarks.decode [--positions 2048] [--prompt 64] [--new 128]
[--batches 1,8] [--rounds 3] [--docs docs/benchmarks.md]`: greedy decoding against
transformers' `generate`.

A Llama built by transformers from a config (random weights, `--positions` positions,
the shape of --layers/--d-model/--heads/--kv-heads/--vocab), saved, and loaded into the
zoo with `models.io.hub.load`; then for each batch size, prompts of `--prompt` random
tokens and `--new` greedy tokens per row: namedmesh's `Decoder.decode` (one prefill pass,
then one cached step per token) against `model.generate(do_sample=False)` eager, and
with a static cache and the model's forward under `torch.compile` (`--compile`,
transformers' recipe), all single-threaded, timed by
CPU time and alternated in one process (benchmarks/fair.py). Both decode the same
prompts with the same weights: the share of equal tokens is printed beside the times.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from benchmarks import cli, fair, report, zoo_families

SECTION = "## Decoding: greedy tokens against transformers' generate"
FAMILY_SECTION = "## Decoding, every decoder family: greedy tokens against generate"


def build(args, folder: str):
    """The transformers Llama (saved to `folder`) and the zoo's Decoder of the same weights."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.d_ff, max_position_embeddings=args.positions,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    model, dec = saved_pair(transformers.LlamaForCausalLM, cfg, folder)
    if args.compile:  # a second copy whose forward torch.compile runs (transformers'
        # recipe for a static cache: on CPU generate does not compile by itself)
        args.compiled = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        args.compiled.forward = torch.compile(args.compiled.forward)
    return model, dec


def saved_pair(model_cls, config, folder: str, slots: int | None = None):
    """(transformers' `model_cls(config)` with seed 0's weights, saved to `folder`, and
    the zoo's Decoder of that folder with `slots` cache slots)."""
    import torch

    from models.cli.generate import Decoder
    from models.io import hub

    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    zoo = hub.load(folder)
    return model, Decoder(zoo.params, zoo.config, slots=slots)


def generate_fn(model, rows, new: int, static: bool):
    """A call of transformers' greedy `generate` on `rows` (an array, or token lists of
    different lengths: left-padded with 0 and masked, as generate takes a batch),
    returning the new tokens."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor(np.stack([np.pad(r, (width - len(r), 0)) for r in rows]), dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = {"cache_implementation": "static"} if static else {}

    def run():
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=0, **kw,
            )  # fmt: skip
        return out[:, ids.shape[1] :].numpy()

    return run


def prompts(batch: int, args, ragged: bool = False) -> list[np.ndarray]:
    """`batch` prompts of random tokens: `--prompt` tokens each, or with `ragged` lengths
    spread evenly from a quarter of that to all of it."""
    rng = np.random.default_rng(batch)
    if not ragged:
        return list(rng.integers(1, args.vocab, (batch, args.prompt)))
    lengths = np.linspace(max(1, args.prompt // 4), args.prompt, batch).astype(int)
    return [rng.integers(1, args.vocab, n) for n in lengths]


def measure(model, dec, batch: int, args, ragged: bool = False) -> dict:
    """CPU seconds per round of each side at one batch size, and the tokens' agreement."""
    rows = prompts(batch, args, ragged)
    ours = lambda: dec.decode(rows, args.new)
    sides = {"namedmesh": ours, "generate": generate_fn(model, rows, args.new, False)}
    failed = {}
    if args.compile:
        compiled = generate_fn(args.compiled, rows, args.new, True)
        try:
            compiled()
            sides["generate, static cache, torch.compile"] = compiled
        except Exception as e:  # no compiler on this machine: say so in the row
            failed["generate, static cache, torch.compile"] = fair.why_not(e)
    tokens = ours(), sides["generate"]()
    agree = float(np.mean(tokens[0] == tokens[1]))
    return {"times": fair.alternate(sides, args.rounds), "agree": agree, "failed": failed}


def family_decoder(name: str, args, folder: str):
    """transformers' model of a decoder family (benchmarks/zoo_families.py's config at
    these sizes, `--positions` positions, no end token: every row decodes `--new`
    tokens), saved to `folder`, and the zoo's Decoder of it."""
    import transformers

    specs = zoo_families.configs(args.layers, args.d_model, args.heads, args.vocab, args.positions)
    model_cls, config_cls, kwargs = specs[name]
    config = getattr(transformers, config_cls)(**{**kwargs, "eos_token_id": None})
    return saved_pair(getattr(transformers, model_cls), config, folder)


def decoder_families() -> list[str]:
    """The families of models/families/ that decode by themselves (no encoder)."""
    from models.io import hub

    return [name for name, f in hub.FAMILIES.items() if f.model == "lm"]


def families(args, names: list[str]) -> tuple[dict, list[str]]:
    """Each family at batch 1 and at each larger batch of `--batches` with prompts of
    different lengths: ({label: measure's result}, markdown lines)."""
    results = {}
    for name in names:
        model, dec = family_decoder(name, args, tempfile.mkdtemp(prefix=f"decode_{name}_"))
        for batch in args.batches:
            label = f"{name}, batch {batch}" + (", ragged" if batch > 1 else "")
            results[label] = measure(model, dec, batch, args, ragged=batch > 1)
            t = results[label]["times"]
            print(f"{label}: {fair.ratio(t['namedmesh'], t['generate'])}, load {fair.load()}",
                  flush=True)  # fmt: skip
    rows = {label: r["times"] for label, r in results.items()}
    agree = {label: f"{r['agree']:.0%}" for label, r in results.items()}
    failed = {label: r["failed"] for label, r in results.items()}
    return results, fair.table(rows, "family, batch", failed, ("equal tokens", agree), "s")


def table(results: dict[int, dict]) -> list[str]:
    """Markdown rows: per batch, namedmesh's seconds and each PyTorch side's with its ratio."""
    first = next(iter(results.values()))
    others = [n for n in first["times"] if n != "namedmesh"] + list(first["failed"])
    head = ["batch", "namedmesh s"]
    for name in others:
        head += [f"{name} s", "ratio"]
    lines = ["| " + " | ".join([*head, "equal tokens"]) + " |", "|" + "---|" * (len(head) + 1)]
    for batch, r in results.items():
        t = r["times"]
        cells = [str(batch), fair.cell(t["namedmesh"], 1)]
        for name in others:
            if name in t:
                cells += [fair.cell(t[name], 1), fair.ratio(t["namedmesh"], t[name])]
            else:
                cells += [f"not run: {r['failed'][name]}", "—"]
        lines.append("| " + " | ".join([*cells, f"{r['agree']:.0%}"]) + " |")
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=cli.prog_name(), description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=cli.count, default=2048, help="the model's positions")
    p.add_argument("--layers", type=cli.count, default=4)
    p.add_argument("--d-model", type=cli.count, default=256)
    p.add_argument("--heads", type=cli.count, default=4)
    p.add_argument("--kv-heads", type=cli.count, default=2)
    p.add_argument("--d-ff", type=cli.count, default=688)
    p.add_argument("--vocab", type=cli.count, default=4096)
    p.add_argument("--prompt", type=cli.count, default=64, help="prompt tokens per row")
    p.add_argument("--new", type=cli.count, default=128, help="greedy tokens per row")
    p.add_argument("--batches", type=cli.counts, default=[1, 8], help="batch sizes")
    p.add_argument("--rounds", type=cli.count, default=3, help="timed rounds (min and median)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also time generate with a static cache under torch.compile")  # fmt: skip
    p.add_argument("--docs", default=None, help="replace this section of a markdown file")
    p.add_argument("--families", nargs="?", const="all", default=None, metavar="NAMES",
                   help="decode each decoder family of models/families/ (all, or a list) "
                        "instead of the Llama; batches above 1 get prompts of different "
                        "lengths")  # fmt: skip
    args = p.parse_args(argv)
    threads = fair.single_threaded()  # before jax's first computation
    if args.families is not None:
        known = decoder_families()
        names = known if args.families == "all" else args.families.split(",")
        if unknown := [n for n in names if n not in known]:
            p.error(f"--families: unknown {unknown}; decoder families: {', '.join(known)}")
        return family_section(args, names, threads, argv)
    model, dec = build(args, tempfile.mkdtemp())
    before = fair.load()
    results = {}
    for batch in args.batches:
        results[batch] = measure(model, dec, batch, args)
        print(table({batch: results[batch]})[-1], flush=True)
    what = (
        f"A Llama of {args.layers} layers, d_model {args.d_model}, {args.heads} heads "
        f"({args.kv_heads} key/value heads), d_ff {args.d_ff}, vocab {args.vocab}, "
        f"{args.positions} positions (random weights); prompts of {args.prompt} tokens, "
        f"{args.new} greedy tokens per row, seconds per whole decode (prefill included)."
    )  # fmt: skip
    section(SECTION, what, table(results), args, argv, (before, threads))
    return results


def section(heading: str, what: str, lines: list[str], args, argv, before_threads) -> None:
    """Print a section (heading, command, what was run, the method with the load before
    it and now, the table `lines`) and with --docs write it into that markdown file."""
    before, threads = before_threads
    method = fair.METHOD.format(flags=fair.XLA_SINGLE_THREAD, rounds=args.rounds,
                                before=before, after=fair.load())  # fmt: skip
    text = [
        heading, "",
        f"Made by `{report.command('benchmarks.decode', argv or sys.argv[1:])}`.", "",
        f"{what} {method} ({threads})", "",
        *lines,
    ]  # fmt: skip
    print("\n".join(text))
    if args.docs:
        report.write_section(args.docs, heading, "\n".join(text) + "\n")


def family_section(args, names: list[str], threads: str, argv) -> dict:
    """Run `families` and print (and with --docs write) its section."""
    if args.compile:  # each family's static-cache program compiled per batch: too long here
        args.compile = False
        print("--families times generate eager only (--no-compile implied)")
    args.compiled = None
    before = fair.load()
    results, lines = families(args, names)
    what = (
        f"Each decoder family at {args.layers} layers, d_model {args.d_model}, {args.heads} "
        f"heads (half as many key/value heads where the family groups them), d_ff "
        f"{2 * args.d_model}, vocab {args.vocab}, {args.positions} positions, with its own "
        f"options (benchmarks/zoo_families.py; random weights, no end token); at batch 1 a "
        f"prompt of {args.prompt} tokens, at larger batches prompts of different lengths "
        f"from {max(1, args.prompt // 4)} to {args.prompt} tokens (\"ragged\": right-padded "
        f"for namedmesh, left-padded and masked for generate); {args.new} greedy tokens per "
        f"row, seconds per whole decode (prefill included), namedmesh's `Decoder.decode` "
        f"against `generate(do_sample=False)` eager."
    )  # fmt: skip
    section(FAMILY_SECTION, what, lines, args, argv, (before, threads))
    return results


if __name__ == "__main__":
    sys.exit(cli.run(main))
