"""What `train --init-from SOURCE [--step N]` starts from: SOURCE is a Hugging Face
folder (its config, weights and tokenizer) or a training run's --out folder, as every
subcommand takes it (models/io/source.py): the run's model, config and tokenizer, and its
weights at step N (its latest without --step; LoRA adapters merged).

    namedmesh train --init-from runs/tiny --step 200 --data notes.txt --out runs/notes

A fine-tune of a run is a fine-tune: a new --out, a fine-tune's optimizer defaults, its
architecture the run's (--set of it refused). It is self-contained as a fine-tune of a
folder is: OUT/base is what describes its model, a copy of the Hugging Face folder's
files for a model of a folder's (the run's own OUT/base), else the record (run.json) of
the run of the zoo's that made it; run.json records init_from and the step read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from models import zoo
from models.io import files, hub
from models.io.source import hub_base, is_run, no_steps, read_run, run_config
from models.training import checkpoint, data
from namedmesh.errors import ParameterError


def model(args, out: Path, from_hub):
    """(model, cfg, tokenizer) that a fine-tune (args.init_from) trains, args.model,
    .config and .tokenizer set to the source's and args.step to the step read (its
    latest when None); `from_hub(args, folder=None)` reads a Hugging Face folder's
    (models/training/run.py). A resumed fine-tune reads its own OUT/base, not the source (and no
    tokenizer: the run's own is read)."""
    base = out / hub.BASE
    if args.resume and (base / "config.json").exists():
        return from_hub(args)
    if args.resume and is_run(base):
        return from_zoo_run(args, base, None)
    source = Path(args.init_from)
    if not is_run(source):
        if args.step is not None:
            raise no_steps(source, args.step)
        return from_hub(args)
    args.step = checkpoint.check_step(source, args.step)  # a step it lacks: the saved ones
    if (folder := hub_base(source)) is not None:  # a run fine-tuned from a folder
        return from_hub(args, folder)
    record = source / hub.BASE if is_run(source / hub.BASE) else source
    return from_zoo_run(args, record, data.load_tokenizer(source))


def from_zoo_run(args, record: Path, tokenizer):
    """(model, cfg, tokenizer) of a model of the zoo's, as the run in `record` (a
    run's folder or a fine-tune's copy of its record, OUT/base) made it; its learned
    position table keeps its rows, so --length may only shorten it."""
    flags = files.read_json(record / "run.json", f"{record}/run.json")
    cfg = run_config(record, flags)
    cfg = cfg.replace(max_positions=cfg.learned_positions)
    if tokenizer is not None:  # a fresh fine-tune (a resumed one has its own)
        stored = flags.get("tokenizer")  # a tokenizer.json's folder holds its chat template
        given = stored not in ("byte", "bpe") and stored and Path(stored).is_file()
        args.tokenizer = stored if given else f"{stored} of --init-from"
    args.model, args.config = flags["model"], flags["config"]
    if cfg.learned_positions and (args.length or cfg.length) > cfg.learned_positions:
        raise ParameterError(
            f"--length {args.length} is longer than the {cfg.learned_positions} positions of "
            f"--init-from {args.init_from}"
        )
    return zoo.get(flags["model"]), cfg, tokenizer


def weights(args, mesh, layout) -> tuple[dict, str]:
    """(parameters, what they are) that a fresh fine-tune starts from: a folder's, each
    shard read onto its devices, or a run's checkpoint at args.step."""
    if is_run(args.init_from):
        params = read_run(args.init_from, args.step)[1]
        return params, f"{args.init_from} at step {args.step}"
    return hub.load(args.init_from, mesh, layout).params, str(args.init_from)


def copy_base(source, dest: Path) -> str | None:
    """Write OUT/base (`dest`) for a fine-tune of `source`: a Hugging Face folder's
    files (hub.copy_base), a fine-tuned run's own OUT/base, or the record of a run of
    the zoo's; the family of a folder's model, None for the zoo's."""
    source = Path(source)
    if not is_run(source):
        return hub.copy_base(source, dest)
    if (source / hub.BASE / "config.json").exists():
        return hub.copy_base(source / hub.BASE, dest)
    if (folder := hub_base(source)) is not None:  # fine-tuned before OUT/base existed
        return hub.copy_base(folder, dest)
    record = source / hub.BASE if is_run(source / hub.BASE) else source
    try:
        files.replace_folder(dest, lambda new: shutil.copyfile(record / "run.json",
                                                               new / "run.json"))  # fmt: skip
    except files.FileWriteError as e:
        raise hub.SaveError(str(e)) from None
    return None
