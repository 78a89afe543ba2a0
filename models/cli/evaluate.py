"""`namedmesh eval SOURCE --data FILE`: a decoder LM's loss on data, on a mesh under a layout.

    namedmesh eval runs/tiny --data notes.txt --mesh rows=2,cols=4 --layout "batch:rows"
    namedmesh eval runs/tiny --step 200 --data notes.txt
    namedmesh eval hf/gpt2 --data val.bin --batch 4 --length 256

SOURCE is a training run's --out folder (its latest checkpoint, or --step's, and its
tokenizer) or a Hugging Face folder of a decoder LM (gpt2, llama), as every subcommand
takes it (models/io/source.py). --data is anything `train --data` takes (text, .bin/.npy
token ids, JSON lines, Parquet, a datasets folder). The data is cut into consecutive
windows of --length + 1 tokens, each starting where the previous one's targets end
(every token after the first is predicted once, from up to --length tokens before it;
the last window holds what is left); prints the mean next-token cross-entropy in nats
per token, its perplexity (exp of it) and bits per byte (nats / ln 2 / the scored
tokens' UTF-8 bytes per token), with a progress bar over the batches. Chat data (JSON
lines of `messages`, docs/chat.md) is rendered with the model's chat template and packed
into rows of --length: the loss is over the assistant's tokens alone.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from models.cli import cluster
from models.cli.train import fail, one_line_on_ctrl_c, user_errors
from models.cli.train_flags import (
    CLUSTER_RANGES,
    COUNT,
    Defaults,
    Parser,
    Range,
    check_ranges,
    parse_mesh,
)
from models.io.source import add_source, resolve, template_folder

# Every numeric flag's allowed values, checked before the model is read (models/cli/train.py)
RANGES = {
    "batch": Range(1, COUNT),
    "length": Range(1, COUNT),
    "max_batches": Range(1, COUNT),
    "step": Range(0, COUNT),
    **CLUSTER_RANGES,
}


def arguments(argv=None, prog: str = "python -m models.cli.evaluate") -> argparse.Namespace:
    p = Parser(
        prog=prog,
        description=__doc__.split("\n")[0],
        formatter_class=Defaults,
    )
    add_source(p)
    p.add_argument("--data", required=True, help="the data: any kind `train --data` takes")
    p.add_argument("--text-field", default="text", help="documents' field in JSON lines/Parquet")
    p.add_argument(
        "--data-format",
        default="auto",
        choices=["auto", "text", "chat"],
        help="chat: conversations, the loss on the assistant's tokens (docs/chat.md)",
    )
    p.add_argument("--mesh", type=parse_mesh, default={"data": 1}, help="e.g. rows=2,cols=4")
    p.add_argument("--layout", default="", help='e.g. "batch:rows;heads:cols" (empty: batch split)')
    p.add_argument("--batch", type=int, default=8, help="windows per batch")
    p.add_argument("--length", type=int, default=None, help="tokens per window (None: model's)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    p.add_argument("--quiet", action="store_true", help="no progress bar nor --layout auto's table")
    cluster.add_flags(p)
    return resolve(p, p.parse_args(argv))


def load(folder: str, step: int | None = None):
    """(model, params, cfg, tokenizer) of a run (its checkpoint at `step`, the latest by
    default) or a Hugging Face decoder LM folder (ParameterError for a `step`)."""
    from models import zoo
    from models.cli import generate
    from models.io import files, hub
    from models.training import data
    from models.training.checkpoint import CheckpointError

    path = Path(folder)
    if (path / "run.json").exists():  # a run: its model said before generate.load's words
        name = files.read_json(path / "run.json", "the run's record")["model"]
        if zoo.get(name).objective != "lm":
            raise CheckpointError(
                f"{folder} holds a {name!r} model; eval measures next-token perplexity of "
                "a decoder LM (lm, moe)"
            )
        return zoo.get(name), *generate.load(path, step)
    if step is not None:  # not a run: generate.load refuses the step, naming the folder
        generate.load(path, step)
    family, _ = hub.read_config(path)
    if family not in hub.DECODERS:
        raise hub.UnsupportedModelError(
            f"{folder} holds a {family} model; eval measures next-token perplexity of a "
            f"decoder LM ({', '.join(hub.DECODERS)})"
        )
    model = hub.load(path)  # without a tokenizer.json (an exported byte run): bytes
    tok = data.ByteTokenizer() if model.tokenizer is None else data.BPETokenizer(model.tokenizer)
    return zoo.get("lm"), model.params, model.config, tok


def cut(text, tokenizer, length: int, objective: str, source: str):
    """(corpus, window): `text` (as corpora.load reads it) cut into windows of `length`
    tokens, or, text or token ids shorter than one, into one window of their own length
    (not one padded to it: a Llama folder's default length is 131,072)."""
    from models.training import corpora, data

    corpus = corpora.make(text, tokenizer, length, objective, text, template_folder(source))
    if isinstance(corpus, data.Corpus) and len(corpus.valid) - 1 < length:
        shorter = len(corpus.valid) - 1  # Corpus refused data with nothing to predict
        return corpora.make(text, tokenizer, shorter, objective, text), shorter
    return corpus, length


def trained_capacity(cfg, window: int):
    """`cfg` for rows of `window` tokens whose capacity routing keeps the model's own
    slots per expert (those of a row of its cfg.length, models/layers/moe.py's
    `capacity`), not a window's: a window then routes as the same tokens do at the
    start of a training row, or in `generate`, whatever --length or the data's length."""
    from models.layers import moe

    slots = moe.capacity(cfg) if cfg.routing == "capacity" else 0
    if slots < 1 or window == cfg.length:  # no slots (factor 0) are none at any length
        return cfg.replace(length=window)
    # half a slot under `slots`: the window's ceil(k * factor * window / experts) is
    # `slots` whatever the float rounding (moe.capacity caps it at the window)
    factor = (slots - 0.5) * cfg.experts / (cfg.experts_per_token * window)
    return cfg.replace(length=window, capacity_factor=factor)


def evaluate(args, dog=None) -> dict:
    """{"loss", "perplexity", "bits_per_byte", "tokens"} of the model on the data; with
    several processes, every wait on the others bounded by `dog` (models/training/watchdog.py)."""
    import jax
    from tqdm import tqdm

    from lowering import Layout, Mesh
    from lowering.distributed import place
    from models.training import corpora
    from models.training.run import UsageError, pick_layout
    from models.training.trainer import Trainer, bits_per_byte
    from models.training.watchdog import COMPILE_S, Watchdog, paced

    dog = dog or Watchdog(enabled=False)
    dog.expect(COMPILE_S, "the processes' agreement and the model's load")
    cluster.check_flags(args)
    if complaint := check_ranges(args, RANGES):
        raise UsageError(complaint)
    model, params, cfg, tokenizer = load(args.source, args.step)
    length = args.length or cfg.length
    if cfg.learned_positions and length > cfg.learned_positions:
        raise UsageError(
            f"--length {length} is longer than the {cfg.learned_positions} positions of "
            f"{args.source}"
        )
    text = corpora.load(args.data, "--data", args.text_field, args.data_format)
    corpus, window = cut(text, tokenizer, length, model.objective, args.source)
    cfg = trained_capacity(cfg, window).replace(batch=args.batch, dropout=0.0, moe_loss=0.0)
    mesh = Mesh(args.mesh)
    if jax.process_count() > 1:  # one global program over every process's devices
        cluster.say(cluster.describe(mesh))
    quiet = args.quiet or jax.process_index() != 0
    say = (lambda *_, **__: None) if quiet else print  # --quiet: the result line alone
    layout = pick_layout(args.layout, Trainer(model, cfg, mesh, Layout()), args.source, say=say)
    trainer = Trainer(model, cfg, mesh, layout)
    # stacks a stage split does not divide held padded, each stage device its slots, as
    # the trainer holds them (Trainer.padded), not L long on every stage device
    state = {"params": place(trainer.padded(params), mesh, layout)}
    windows = corpus.validation_windows()
    total = -(-windows // args.batch)
    if args.max_batches is not None:
        total = min(total, args.max_batches)
    batches = corpus.validation_batches(args.batch, args.max_batches)
    bar = tqdm(batches, total=total, disable=quiet, unit="batch", dynamic_ncols=True)
    loss, tokens = trainer.evaluate(state, paced(bar, dog, "batch"))
    told = "--length" if args.length else "the model's training length"
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": bits_per_byte(loss, corpus.bytes_per_token(total * args.batch)),
        "tokens": tokens,
        "length": window,  # the window: tokens scored per window, each after its previous
        "windows": min(windows, total * args.batch),
        "length_from": told if window == length else "the data's length",
    }


@one_line_on_ctrl_c
def main(argv=None, prog: str = "python -m models.cli.evaluate") -> int:
    args = arguments(argv, prog)
    name = prog.removeprefix("python -m ")
    try:
        several = cluster.join(args, math.prod(args.mesh.values()))
    except cluster.ClusterError as e:
        return fail(e, 2, name)
    from models.training.data import DataError
    from models.training.watchdog import Watchdog

    try:
        with Watchdog(enabled=several) as dog:
            out = evaluate(args, dog)
    except (*user_errors(), DataError, KeyError) as e:  # one line, never a traceback
        return cluster.ended(fail(e, 2, name), several)
    except cluster.lost_peer_errors() as e:
        return cluster.ended(fail(cluster.lost(e), cluster.EXIT_LOST, name), several)
    cluster.say(
        f"loss {out['loss']:.4f} nats/token, perplexity {out['perplexity']:.3f}, "
        f"{out['bits_per_byte']:.4f} bits/byte over {out['tokens']:,} tokens in "
        f"{out['windows']:,} windows of {out['length']} ({out['length_from']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
