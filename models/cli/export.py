"""`namedmesh export SOURCE --out DIR [--step N] [--dtype D] [--max-shard-size S]`: a
training run's checkpoint (the latest by default) as a Hugging Face folder (config.json,
model.safetensors or its shards with an index, tokenizer.json) that transformers loads.

SOURCE is the run's --out folder, and --step its checkpoint, as every subcommand takes
them (models/io/source.py).

A run fine-tuned from a Hugging Face folder (`train --init-from`) goes back out as its
base's family with the base's config.json, generation_config.json, tokenizer_config.json
and chat template, from the run's copy of them (RUN/base: the base folder is not read).
A run of the zoo's `lm` goes out as GPT-2, whose architecture it shares where its
config has layer norms, tanh-GELU, learned
positions, tied embeddings and d_kv * heads == d_model: its missing biases are zeros
and the tied softmax's d_model**-0.5 is folded into the final norm. Other models, and
an lm with an option GPT-2's config.json cannot say (embed_scale...), are refused by
name. A byte-tokenizer run writes no tokenizer.json (it has no `tokenizers` form);
`namedmesh eval` reads such a folder with the byte tokenizer.

`--out` is a new folder, an empty one, or an earlier export (its marker file
`.namedmesh-export` lists what it wrote, and nothing else is there): never the run's
folder, a folder above it or above the current folder, a folder holding anything
else, nor a file (DestinationError, naming the folder). The export is written whole
in a folder beside `--out` and renamed into place, so a killed or failed export
leaves what was there as it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from models.cli import cluster
from models.cli.train import fail, one_line_on_ctrl_c, user_errors
from models.cli.train_flags import Parser

# re-exported (`export.check_destination`, `export.DestinationError`): their home was here
from models.io.export_rules import GPT2_FIELDS as GPT2_FIELDS
from models.io.export_rules import MARKER as MARKER
from models.io.export_rules import DestinationError as DestinationError
from models.io.export_rules import as_gpt2 as as_gpt2
from models.io.export_rules import check_destination as check_destination
from models.io.export_rules import gpt2_config as gpt2_config
from models.io.source import add_source, hub_base, need_checkpoint, resolve


def arguments(argv=None, prog: str = "python -m models.cli.export") -> argparse.Namespace:
    p = Parser(prog=prog, description=__doc__.split("\n")[0])
    add_source(p, "a training run's --out folder")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="of the weights written (training keeps float32)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        type=_size,
        metavar="SIZE",
        help="above it the weights go in shards with model.safetensors.index.json, as "
        "transformers' save_pretrained (5GB, 200MB, 1GiB or bytes; default 5GB)",
    )
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run's adapters alone, as PEFT writes them (adapter_config.json, "
        "adapter_model.safetensors); without it a LoRA run exports merged (W + alpha/r A B)",
    )
    cluster.add_flags(p)
    args = resolve(p, p.parse_args(argv))
    if args.adapter_only and args.max_shard_size is not None:  # not ignored silently
        p.error("--max-shard-size with --adapter-only: the adapters are one file, as PEFT "
                "writes them; drop --max-shard-size")  # fmt: skip
    return args


def _size(text: str) -> str:
    """--max-shard-size's text, checked (the size itself is models.io.shards.parse_size's)."""
    from models.io.shards import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).partition(": ")[2]) from None
    return text


def export(
    run: str | Path,
    out: str | Path,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
) -> Path:
    """Write the run's checkpoint at `step` (the latest by default) to `out` as a
    Hugging Face folder, its weights in `dtype`, sharded above `max_shard_size` (as
    models.io.hub.save; DestinationError, before anything is read, for an `out` that
    `check_destination` refuses)."""
    from models.cli import generate
    from models.io import files, hub
    from models.training import data

    run = Path(run)
    where = check_destination(out, run)
    if (run / "config.json").exists() and not (run / "run.json").exists():
        raise hub.HubError(f"{run} is a Hugging Face folder already; export reads a run")
    need_checkpoint(run)
    params, cfg, tokenizer = generate.load(run, step)  # refuses runs that are not decoder LMs
    base = generate.base_folder(run)  # a fine-tune's copy of its base's files
    if (folder := hub_base(run)) is not None:  # a model of a Hugging Face folder's
        family, hf = hub.read_config(folder)
    else:
        family, hf = "gpt2", gpt2_config(cfg)
        params, cfg = as_gpt2(params, cfg)
    tok = tokenizer.tok if isinstance(tokenizer, data.BPETokenizer) else None
    write_model = hub.writer(hub.HubModel(family, cfg, params, tok, hf), dtype, max_shard_size)

    def write(folder: Path) -> None:  # the whole export, then renamed into place
        write_model(folder)
        for name in ("generation_config.json", "tokenizer_config.json",
                     "special_tokens_map.json", "chat_template.jinja"):  # fmt: skip
            if base is not None and (base / name).exists():
                shutil.copyfile(base / name, folder / name)
        names = sorted(p.name for p in folder.iterdir())
        (folder / MARKER).write_text(json.dumps({"run": str(run.resolve()), "files": names}))

    files.replace_folder(where, write)
    return Path(out)


@one_line_on_ctrl_c
def main(argv=None, prog: str = "python -m models.cli.export") -> int:
    args = arguments(argv, prog)
    try:  # one process's work: process 0 writes the folder alone, the others end at once
        if cluster.rank(args) != 0:
            return 0
    except cluster.ClusterError as e:
        return fail(e, 2, prog.removeprefix("python -m "))
    try:
        if args.adapter_only:
            from models.io.adapter_export import export_adapters

            folder = export_adapters(args.source, args.out, args.step, args.dtype)
            print(f"wrote {folder}/adapter_config.json, adapter_model.safetensors ({args.dtype})")
            return 0
        folder = export(args.source, args.out, args.step, args.dtype, args.max_shard_size)
    except (*user_errors(), KeyError) as e:  # one line, never a traceback
        return fail(e, 2, prog.removeprefix("python -m "))
    weights = sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")
    shards = f"{len(weights)} shards and model.safetensors.index.json" if len(weights) > 1 else ""
    print(f"wrote {folder}/config.json, {shards or weights[0]} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
