"""SOURCE: how every subcommand that reads a model takes it (generate, eval, export).

    namedmesh generate runs/tiny --step 200 --prompt "The"
    namedmesh eval hf/gpt2 --data val.txt
    namedmesh export runs/tiny --step 200 --out hf/tiny

One positional SOURCE, a training run's --out folder or a Hugging Face folder, and
`--step N` to read a run's checkpoint at step N instead of its latest (a step the run
has not saved is refused, naming the steps it has; a Hugging Face folder has no steps).
An older spelling (`generate --checkpoint X`) still works, with a one-line note on
stderr saying the new one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SOURCE = "SOURCE"  # the positional's name in usage lines and did-you-mean hints
WHAT = "a training run's --out folder, or a Hugging Face folder"


def add_source(p: argparse.ArgumentParser, what: str = WHAT, old: tuple[str, ...] = ()) -> None:
    """SOURCE (described by `what`), --step, and `old`: earlier flags for SOURCE, kept
    working but left out of --help (`resolve` says they are deprecated)."""
    p.add_argument("source", nargs="?", default=None, metavar=SOURCE, help=what)
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="a run's checkpoint at this step (None: its latest)",
    )
    for flag in old:
        p.add_argument(flag, dest=f"old_{flag.lstrip('-')}", default=None, help=argparse.SUPPRESS)


def resolve(p: argparse.ArgumentParser, args: argparse.Namespace, old: tuple[str, ...] = ()):
    """`args` with .source set from SOURCE or an `old` flag (a one-line deprecation note
    on stderr); the parser's one-line error for neither or two different ones."""
    name = p.prog.removeprefix("python -m ")
    for flag in old:
        given = vars(args).pop(f"old_{flag.lstrip('-')}", None)
        if given is None:
            continue
        if args.source is not None and args.source != given:
            p.error(f"{SOURCE} {args.source} and {flag} {given} name two models: give one")
        print(
            f"{name}: note: {flag} is deprecated: write `{name} {given} ...` ({SOURCE} first)",
            file=sys.stderr,
            flush=True,
        )
        args.source = given
    if args.source is None:
        what = next(a.help for a in p._actions if a.metavar == SOURCE)  # argparse's list
        p.error(f"{SOURCE} is missing: {what} (e.g. `{name} runs/tiny ...`)")
    return args


# --- reading a SOURCE: a run's record, its Config, its checkpoint -----------------------


def is_run(path) -> bool:
    """Whether `path` is a training run's --out folder (its record, run.json)."""
    return (Path(path) / "run.json").exists()


def no_steps(folder, step: int):
    """The ParameterError of `--step` given with a Hugging Face folder."""
    from namedmesh.errors import ParameterError

    return ParameterError(
        f"--step {step}: {folder} is a Hugging Face folder, which has no steps; "
        "--step picks a training run's checkpoint"
    )


def hub_base(run) -> Path | None:
    """The Hugging Face folder whose config.json describes a run's model: the run's copy
    of it (RUN/base, written by a fine-tune of a folder, or of a run whose model is a
    folder's), else the folder a fine-tune made before that copy existed read
    (--init-from); None for a model of the zoo's (a run from scratch, a fine-tune of one)."""
    from models.io import files, hub

    base = Path(run) / hub.BASE
    if (base / "config.json").exists():
        return base
    if is_run(base):  # a fine-tune of a run: that run's model
        return hub_base(base)
    init = files.read_json(Path(run) / "run.json", "the run's record").get("init_from")
    if not init:
        return None
    return hub_base(init) if is_run(init) else Path(init)


def run_config(run, flags: dict):
    """The Config of the model a run trains, from its record `flags` (run.json): its
    base's (RUN/base: a Hugging Face folder's config.json, or the record of the run it
    fine-tuned, whose learned position table keeps its rows), else its zoo config with
    its vocabulary; then the run's --batch, --length, --dtype and --set."""
    from models import architecture as config
    from models import catalog, zoo
    from models.io import files, hub

    base = Path(run) / hub.BASE
    if is_run(base):  # fine-tuned from a run of the zoo's: that run's model
        cfg = run_config(base, files.read_json(base / "run.json", f"{base}/run.json"))
        cfg = cfg.replace(max_positions=cfg.learned_positions)  # its weights' rows
    elif (folder := hub_base(run)) is not None:
        cfg = hub.config_of(folder)[1]
    else:
        cfg = zoo.get(flags["model"]).configure(catalog.get(flags["config"]))
        cfg = cfg.replace(vocab=flags["vocab"])
    cfg = cfg.replace(**{k: flags[k] for k in ("batch", "length", "dtype") if flags.get(k)})
    return cfg.replace(**config.parse_overrides(flags.get("set") or []))  # the run's --set


def read_run(run, step: int | None = None, merge: bool = True):
    """(model, params, cfg, tokenizer) of a training run's checkpoint at `step` (the
    latest by default; CheckpointError naming the saved steps for one it lacks), the
    parameters alone on this process's first device. A LoRA run's adapters are merged
    into its weights (models/layers/lora.py) unless `merge` is False; `model` is the zoo's,
    without adapters."""
    import jax

    from models import transformer, zoo
    from models.io import files
    from models.layers.lora import adapted, merged, of_flags
    from models.training import data

    run = Path(run)
    need_checkpoint(run)
    flags = files.read_json(run / "run.json", "the run's record")
    model = zoo.get(flags["model"])
    cfg = run_config(run, flags)
    # The parameters alone, by name: the optimizer's state stays on disk.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # this process's
    adapters = of_flags(flags)  # a LoRA run's: its checkpoint holds them
    target = jax.tree_util.tree_map(  # over the Tensors' data: abstract, on one device
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        transformer.abstract(adapted(model, adapters, cfg).shapes(cfg)),
    )
    params = _restore(run, target, step)
    if adapters is not None and merge:
        params = merged(params, adapters)
    return model, params, cfg, data.load_tokenizer(run)


def need_checkpoint(run) -> None:
    """CheckpointError unless `run` is a training run with a checkpoint, saying which
    of the two it lacks."""
    from models.training import checkpoint

    if not is_run(run):
        raise checkpoint.CheckpointError(f"{run}: no run.json (not a training run's --out)")
    if checkpoint.latest_step(run) is None:
        raise checkpoint.CheckpointError(
            f"{run}: no checkpoint yet (a run saves one every --save-every steps and at "
            "its end): nothing to read"
        )


def _restore(run: Path, target: dict, step: int | None, tries: int = 5) -> dict:
    """The parameters of the run's checkpoint at `step`, or at its newest: a run that is
    still training keeps its newest checkpoints only, and may remove the one chosen as
    the newest before it is read (it saved newer ones meanwhile): then the newest again,
    never an error saying that the step gone is damaged."""
    from models.training import checkpoint

    for _ in range(tries):
        chosen = checkpoint.check_step(run, step)
        try:
            return checkpoint.restore_params(run, target, chosen)[0]
        except (checkpoint.CheckpointError, OSError):
            if step is not None or chosen in checkpoint.all_steps(run):
                raise  # damaged, or asked for: not the run's removal of an old one
    raise checkpoint.CheckpointError(
        f"{run}: the newest checkpoint was removed {tries} times while it was read (the run "
        "saves faster than it can be read): pass --step N of a checkpoint it keeps"
    )


def template_folder(model) -> Path | None:
    """The folder whose chat template renders chat data for `model` (models/training/chat.py):
    a Hugging Face folder, a fine-tune's base, else the folder of the run's
    --tokenizer FILE; None (the default template) otherwise."""
    from models.io import files, hub

    path = Path(model)
    if (path / "config.json").exists() and not is_run(path):
        return path
    if (path / hub.BASE / "config.json").exists():
        return path / hub.BASE
    record = files.read_json(path / "run.json", "the run's record") if is_run(path) else {}
    given = record.get("tokenizer")
    return Path(given).parent if given and Path(given).is_file() else None
