"""The training run behind `python -m models.cli.train`: checks every flag against the
model, the mesh and the data before compiling, then trains with a progress bar,
metrics, checkpoints and a loss plot (see models/cli/train.py for the flags)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

import namedmesh as nm
from lowering import Layout, Mesh, auto_layout
from lowering.joint import with_uneven_stages
from lowering.rates import RatesError, user_cache_dir
from lowering.rates import parse as parse_rates
from models import architecture as config
from models import catalog, transformer, zoo
from models.cli import cluster, settings
from models.cli.train_flags import check_ranges, init_fault, optimizer_fault
from models.io import files, folder_tokens, hub
from models.io.source import template_folder as of_model
from models.layers import lora
from models.layers.common import attention_settings
from models.training import agree, checkpoint, corpora, data, init_from, trainable
from models.training.optim import warmup_note
from models.training.preempt import Preemption
from models.training.trainer import OptimizerSpec, Trainer, TrainSpec, bits_per_byte, optimizer
from models.training.watchdog import COMPILE_S, SAVE_S, Watchdog
from namedmesh.errors import LayoutError, NamedMeshError

# The exit statuses of `python -m models.cli.train` (docs/faults.md lists them too).
EXIT_DONE = 0  # every step trained
EXIT_USAGE = 2  # a bad flag, file or checkpoint: nothing trained (one line on stderr)
EXIT_DIVERGED = 3  # a non-finite step beyond --skip-nonfinite: not applied, not saved
EXIT_SAVE_FAILED = 74  # a checkpoint could not be written (full disk): the older ones kept
EXIT_PREEMPTED = 75  # SIGTERM or SIGINT: a checkpoint saved at a step boundary (EX_TEMPFAIL)

# Flags of a training command that are this invocation's, not the run's: run.json records
# every other flag of the parser (models/cli/train.py), and a --resume reads them back.
PER_INVOCATION = ("help", "resume", "out", "config_file", "coordinator", "num_processes",
                  "process_id", "quiet", "step_timeout", "tensorboard")  # fmt: skip
# Recorded flags that a --resume given them anew applies (saying so in one line): how
# far the run goes, on what data, how often it validates and saves, and how its steps
# are laid out and computed (the same updates of the same state). Any other flag that
# contradicts the record is refused, naming both values.
CHANGEABLE = ("steps", "data", "val_data", "data_format", "eval_every", "eval_batches",
              "save_every", "skip_nonfinite", "mesh", "layout", "rates", "grad_accum", "remat",
              "attention", "attention_block")  # fmt: skip
PATH_FLAGS = ("data", "val_data", "init_from", "tokenizer")  # compared as absolute paths
# flags whose value a run recorded before the flag existed trained with, where that is
# not the flag's default: such a run resumes with it (--decay: weight decay fell on
# every parameter before the default became the matrices alone; --chat-date: chat
# templates rendered without strftime_now before it)
BEFORE_FLAG = {"decay": "all", "chat_date": "none"}


class UsageError(Exception):
    """A flag that cannot work; reported in one line with exit status 2."""


class DivergedError(Exception):
    """A step whose loss or gradient norm is not finite, one more than --skip-nonfinite
    allows; reported in one line with exit status 3."""


def writer() -> bool:
    """Whether this process writes the run's files (metrics, run.json, plot, TensorBoard)
    and draws its progress: process 0 alone. Checkpoints are every process's (orbax)."""
    return jax.process_index() == 0


def model_dims(graph) -> set[str]:
    return {d for v in graph.values() for d in v.dims}


def setup(args):
    """(run settings, model, cfg, tokenizer, corpus, mesh, layout, trainer), all checked."""
    out = Path(args.out)
    has_checkpoint = bool(checkpoint.all_steps(out))
    started = (out / "run.json").exists() or (out / "metrics.jsonl").exists()
    if args.resume and (out / "run.json").exists():
        _resume_flags(args, files.read_json(out / "run.json", "the run's record"), out)
    elif has_checkpoint and args.resume:
        raise UsageError(
            f"--resume: {out} holds checkpoints but no run.json (the run's record, written "
            "before any checkpoint): it cannot be resumed without it"
        )
    elif has_checkpoint:
        raise UsageError(f"{out} holds a run already: pass --resume, or another --out")
    if not has_checkpoint and (started or args.resume):  # a retried command goes on
        said = "a run that never reached a checkpoint" if started else "no run to resume"
        cluster.say(f"{out} holds {said}: starting it afresh")
        args.resume = False
        if writer():
            (out / "metrics.jsonl").unlink(missing_ok=True)
    hub_tokenizer = None
    try:
        if args.init_from:
            given = args.tokenizer  # the source's replaces it
            model, cfg, hub_tokenizer = init_from.model(args, out, from_hub)
            if "tokenizer" in getattr(args, "given", ()) and not args.resume:
                check_same_vocabulary(given, hub_tokenizer, args.init_from)
        else:
            model = zoo.get(args.model)
            cfg = model.configure(catalog.get(args.config))
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    try:
        fmt = getattr(args, "data_format", "auto")
        text = corpora.load(args.data, "--data", args.text_field, fmt)
        valid = args.val_data and corpora.load(args.val_data, "--val-data", args.text_field, fmt)
        if args.resume:
            tokenizer = data.load_tokenizer(out)
        elif hub_tokenizer is not None:
            tokenizer = hub_tokenizer
        elif args.tokenizer == "bpe":
            tokenizer = data.BPETokenizer.train(_bpe_text(text, valid, args.data), args.bpe_vocab)
        elif args.tokenizer == "byte":
            tokenizer = data.ByteTokenizer()
        else:
            tokenizer = data.load_tokenizer_file(args.tokenizer)
        changes = {"vocab": data.padded_vocab(tokenizer.vocab_size, model.objective)}
        if args.init_from:  # the checkpoint's embedding fixes the vocabulary
            changes = {}
        for k in ("batch", "length", "dropout", "dtype", "remat", "attention", "attention_block"):
            if getattr(args, k) is not None:
                changes[k] = getattr(args, k)
        cfg = cfg.replace(**changes, **config.parse_overrides(args.set or []))
        if args.init_from and cfg.length > (cfg.learned_positions or cfg.length):  # --set's
            raise UsageError(
                f"--set length={cfg.length} is longer than the {cfg.learned_positions} "
                f"positions of --init-from {args.init_from}"
            )
        folder = template_folder(args)
        corpus = corpora.make(
            text, tokenizer, cfg.length, model.objective, valid or None, folder,
            date=getattr(args, "chat_date", None),
        )  # fmt: skip
    except (data.DataError, config.ConfigError) as e:
        raise UsageError(str(e)) from None
    try:
        model = lora.adapted(model, lora.of_flags(args), cfg)
        trained = trainable.chooser(
            trainable.paths(model.shapes(cfg)), args.freeze or (),
            lora.is_adapter if args.lora_rank else None,
        )  # fmt: skip
        mesh = Mesh(args.mesh)
        opt, schedule = run_optimizer(args)
        name = f"{args.model} ({args.config})"
        spec = TrainSpec(opt, args.seed, args.grad_accum, trained,
                         keyed=bool(args.lora_rank and args.lora_dropout))  # fmt: skip
        probe = Trainer(model, cfg, mesh, Layout(), spec)
        layout = pick_layout(args.layout, probe, name, getattr(args, "rates", None))
        trainer = Trainer(model, cfg, mesh, layout, spec)
        report = trainer.report()  # plans every value: a layout that cannot work fails here
    except (NamedMeshError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    # the optimizer's state besides: adamw's two moments per parameter, lion's one, sgd's
    # momentum (if any) and adafactor's factored ones (counted as one), on every device
    moments = {"adamw": 2, "lion": 1, "adafactor": 1, "sgd": int(any(args.betas or ()))}
    state = _count(trainer, trained=True) * 4 * moments[args.optimizer]
    check_memory(report.peak_memory + state, mesh, f"--config {args.config}")
    return model, cfg, tokenizer, corpus, mesh, layout, trainer, report, schedule


def run_optimizer(args):
    """(optax transformation, schedule) of the run's optimizer flags."""
    return optimizer(OptimizerSpec.of_flags(args))


DATA_FLAGS = ("data", "val_data")  # paths run.json records absolute, with fingerprints
LIST_FLAGS = ("set", "freeze")  # flags given again and again, recorded as lists


def recorded_actions() -> dict:
    """dest -> argparse action of every flag run.json records (all but PER_INVOCATION)."""
    from models.cli.train_flags import parser

    return {a.dest: a for a in parser()._actions if a.dest not in PER_INVOCATION}


def record_of(args) -> dict:
    """Every recorded flag's value as run.json holds it: as the flag takes it in a
    --config-file (a tuple as its text, `0.9,0.98`; a mesh as a mapping)."""
    values = {k: getattr(args, k, None) for k in recorded_actions()}
    return {k: ",".join(map(str, v)) if isinstance(v, tuple) else v for k, v in values.items()}


def _resume_flags(args, stored: dict, out: Path) -> None:
    """Set the flags of a resumed run from its record `stored` (run.json), checked:
    a value of the wrong type or range, or data that is not what the run started on,
    is a UsageError. A flag given on the command line (`args.given`) or by --config-file
    (`args.filed`) that contradicts the record is a UsageError naming both values, unless
    it is CHANGEABLE: then it wins, said in one line (and kept in `args.record_changes`,
    so that the record follows). A --data or --val-data given anew sets
    `args.data_changed`."""
    given_data = {k: getattr(args, k) for k in DATA_FLAGS}  # None: not given
    stored = BEFORE_FLAG | stored
    complaint = _record_fault(stored)
    if complaint:
        raise UsageError(f"{out}/run.json: {complaint}")
    filed = set(getattr(args, "filed", ())) - set(getattr(args, "given", ()))
    given = set(getattr(args, "given", ())) | filed
    if "step" in given and args.step != stored.get("step"):  # the same command is no change
        began = stored.get("init_from")
        began = f"--init-from {began} at step {stored.get('step')}" if began else "scratch"
        raise UsageError(
            f"--step {args.step}: --resume continues the run in {out} from its own newest "
            f"checkpoint, not from a step of --init-from (it started from {began}, run.json): "
            "drop --step, or fine-tune from that step with another --out"
        )
    args.record_changes = {}
    for k, action in recorded_actions().items():
        if k not in stored or (k in DATA_FLAGS and given_data[k] is not None):
            continue  # a run saved before a flag existed keeps its default
        was = stored[k] if stored[k] is None else settings.checked(action, stored[k])
        now = getattr(args, k, None)
        if k not in given or _same(k, now, was):
            setattr(args, k, was)
            continue
        flag = f"--{k.replace('_', '-')} {_shown(now)}"
        if k in filed:
            flag += f" (of --config-file {args.config_file})"
        if k not in CHANGEABLE:
            raise UsageError(
                f"{flag} contradicts the run in {out}, which recorded {_shown(was)} "
                f"(run.json): drop the flag to resume the run as it was, or start another "
                f"run with another --out"
            )
        print(f"{flag}: the run in {out} recorded {_shown(was)}; going on with {_shown(now)} "
              "as asked")  # fmt: skip
        args.record_changes[k] = record_of(args)[k]
    complaint = check_ranges(args) or optimizer_fault(args) or init_fault(args)  # by hand
    if complaint:
        raise UsageError(f"{out}/run.json: {complaint}")
    args.data_changed = False
    prints = stored.get("fingerprints") or {}
    for k in DATA_FLAGS:
        flag, recorded = f"--{k.replace('_', '-')}", stored.get(k)
        if given_data[k] is not None:
            same = recorded is not None and Path(given_data[k]).absolute() == Path(recorded)
            if not same or (k in prints and _fingerprint(given_data[k], flag) != prints[k]):
                was = recorded or ("the default corpus" if k == "data" else "a tenth of --data")
                print(f"{flag} {given_data[k]}: not the data this run started on ({was}, "
                      f"recorded in {out}/run.json): training on it as asked")  # fmt: skip
                args.data_changed = True
        elif recorded is not None and k in prints:
            now = _fingerprint(recorded, flag)
            if now != prints[k]:
                raise UsageError(
                    f"--resume: {flag} {recorded} is not the data this run started on "
                    f"({prints[k]['bytes']} bytes, sha256 {prints[k]['sha256'][:12]}... in "
                    f"{out}/run.json; now {now['bytes']} bytes, {now['sha256'][:12]}...): pass "
                    f"{flag} {recorded} to go on with it as it is now"
                )


def _same(k: str, a, b) -> bool:
    """Whether a flag's given value `a` is the recorded `b` (paths as absolute paths)."""
    if k in PATH_FLAGS and isinstance(a, str) and isinstance(b, str):
        return a == b or Path(a).absolute() == Path(b).absolute()
    return a == b


def _shown(value) -> str:
    """A flag's value as the command line writes it."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    return str(value)


def _fingerprint(path, flag: str) -> dict:
    try:
        return files.fingerprint(path)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None


def _record_fault(stored: dict) -> str | None:
    """What is wrong with the flags a run's record holds, or None: each recorded flag
    must have the type its parser gives it (a number, one of its choices, text, a list
    of text) or be null."""
    for k, action in recorded_actions().items():
        v = stored.get(k)
        if v is None:
            continue
        if action.nargs == 0:  # a switch
            ok = type(v) is bool
        elif action.type in (int, float):
            ok = type(v) is int or (action.type is float and type(v) is float)
        elif action.choices:
            ok = v in action.choices
        elif k in LIST_FLAGS:
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
        elif callable(action.type):  # --mesh's, --betas': as a --config-file gives them
            ok = _parses(action, v)
        else:
            ok = isinstance(v, str)
        if not ok:
            return f"{k!r} holds {v!r}, not a value of --{k.replace('_', '-')}"
    return None


def _parses(action, value) -> bool:
    try:
        settings.checked(action, value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        return False
    return True


def check_memory(per_device: int, mesh, what: str) -> None:
    """UsageError when a per-device estimate (the lowering report's peak memory and the
    optimizer's state, replicated at most), on every device of the mesh this process
    holds, exceeds the memory it has: the host's available memory for CPU devices (which
    share it), else each device's own limit. Checked before any parameter exists, so a
    model too big is refused in seconds, not killed in minutes."""
    devices = [d for d in mesh.jax_mesh.devices.flat if d.process_index == jax.process_index()]
    if devices[0].platform == "cpu":
        import psutil

        need, have, where = per_device * len(devices), psutil.virtual_memory().available, "host"
    else:
        stats = devices[0].memory_stats() or {}
        need, have, where = per_device, stats.get("bytes_limit"), "device"
    if have is not None and need > have:
        raise UsageError(
            f"{what} needs an estimated {need / 2**30:.1f} GiB ({per_device / 2**30:.1f} GiB "
            f"per device: the lowering report's peak and the optimizer's state, x "
            f"{len(devices)} devices) but the {where} has {have / 2**30:.1f} GiB available: "
            "pass a smaller --batch or "
            "--length, --remat full, or a layout that splits the model"
        )


def template_folder(args) -> Path | None:
    """The folder whose chat template renders chat data (models/training/chat.py): a fine-tune's
    base, else the folder of a --tokenizer FILE; None (the default template) for the
    byte and a fresh BPE tokenizer."""
    if args.init_from:  # as eval finds a model's: its base, a run's tokenizer's folder
        resumed = args.resume and (Path(args.out) / hub.BASE).exists()
        return of_model(args.out if resumed else args.init_from)
    given = Path(args.tokenizer)
    return given.parent if args.tokenizer not in ("byte", "bpe") and given.is_file() else None


def _bpe_text(text, valid, path) -> str:
    """The text a `--tokenizer bpe` trains on: the training split of a text (of chat
    data, the messages' contents)."""
    from models.training.chat import Conversations

    if isinstance(text, Conversations):
        return text.text() if valid is not None else text.split(data.VALIDATION_FRACTION)[0].text()
    if not isinstance(text, str):
        raise data.DataError(
            f"--tokenizer bpe trains on text, but --data {path} holds token ids: pass the "
            "tokenizer.json they were made with (--tokenizer FILE), or byte"
        )
    return data.split(text)[0] if valid is None else text


def from_hub(args, folder=None):
    """(model, cfg, tokenizer) of the Hugging Face folder `args.init_from` (or `folder`:
    a run's copy of its own): a decoder LM (hub.DECODERS) with its tokenizer
    (models/io/folder_tokens.py; a folder without one is refused, never given the byte
    tokenizer). args.config becomes the family's name."""
    base = Path(args.out) / hub.BASE  # a resumed fine-tune's copy of its base
    if folder is None:
        folder = base if args.resume and (base / "config.json").exists() else args.init_from
    try:
        family, cfg = hub.config_of(folder)
        if family not in hub.DECODERS:
            raise UsageError(
                f"--init-from: {args.init_from} holds a {family} model; fine-tuning reads "
                f"decoder LMs ({', '.join(hub.DECODERS)})"
            )
        tokenizer = folder_tokens.required(folder, family, "--init-from")
    except hub.HubError as e:
        raise UsageError(f"--init-from: {e}" if "--init-from" not in str(e) else str(e)) from None
    tokenizer = data.BPETokenizer(tokenizer)
    args.model, args.config = "lm", family
    args.tokenizer = f"{folder_tokens.source(folder)} of --init-from"
    if tokenizer.vocab_size > cfg.vocab:
        raise UsageError(
            f"--init-from: the tokenizer has {tokenizer.vocab_size} ids, the model's embedding "
            f"{cfg.vocab}"
        )
    if cfg.learned_positions and (args.length or cfg.length) > cfg.learned_positions:
        raise UsageError(
            f"--length {args.length} is longer than the {cfg.learned_positions} positions of "
            f"{args.init_from}"
        )
    return zoo.get("lm"), cfg, tokenizer


def check_same_vocabulary(given: str, folder_tokenizer, folder) -> None:
    """UsageError unless the --tokenizer given beside --init-from maps every token to the
    id the folder's (or run's) does (the embedding's rows are its ids)."""
    why = f"--tokenizer {given}: a fine-tune of --init-from {folder} reads its tokenizer"
    if given == "byte" and isinstance(folder_tokenizer, data.ByteTokenizer):
        return
    if given in ("byte", "bpe"):
        raise UsageError(f"{why}; {given} is not its vocabulary: drop --tokenizer")
    try:
        theirs = data.load_tokenizer_file(given)
    except data.DataError as e:
        raise UsageError(str(e)) from None
    vocab = lambda t: t.tok.get_vocab() if hasattr(t, "tok") else None
    mine, other = vocab(folder_tokenizer), vocab(theirs)
    if other != mine:
        differ = "" if other is None else f" ({len(other)} tokens, the folder's {len(mine)})"
        raise UsageError(
            f"{why}; {given} is another vocabulary{differ}: drop --tokenizer, or pass "
            "the folder's tokenizer.json"
        )


def pick_layout(text: str, probe: Trainer, name: str, rates=None, say=print) -> Layout:
    """The layout `--layout` names, checked against `probe`'s model (a Trainer of the
    run's model, config, mesh and TrainSpec, under any layout); `auto`: auto_layout's
    choice for the training loss, weighed at `rates` (`--rates`' text: a hardware name of
    lowering.rates.HARDWARE and/or key=value figures, `lowering.rates.parse`; None:
    measured on the mesh, cached in the user cache dir), its printout shown by `say`
    (eval's --quiet: nothing). The search plans the step the run takes: with the spec's
    `grad_accum` N, on microbatches of batch/N rows."""
    if rates is not None and text != "auto":
        raise UsageError("--rates weighs the candidates of --layout auto; pass --layout auto")
    if rates is not None:
        try:
            rates = parse_rates(rates)
        except RatesError as e:
            raise UsageError(f"--rates: {e}") from None
    model, cfg, mesh = probe.model, probe.cfg, probe.mesh
    params, batch = probe.abstract_inputs()
    key = probe.key(1)
    loss = lambda p, b, k: model.loss(p, b, cfg, k)
    if text == "auto":
        if rates is None:
            say(f"measuring the rates of {mesh}'s devices (once; cached) ...", flush=True)
        try:
            found = auto_layout(loss, mesh, params, batch, key, grad_argnums=(0,),
                                rates=rates, cache_dir=user_cache_dir())  # fmt: skip
            say(found[1])
        except LayoutError as e:  # (an uneven stage split may fit where no searched one does)
            found = e
        # a stage axis that does not divide a stack: its padded split weighed, as plan does
        layout, best = with_uneven_stages(loss, mesh, (params, batch, key), found,
                                          transformer.CHAIN)  # fmt: skip
        if isinstance(found, LayoutError) or layout is not found[0]:
            # the table above ends in its own "chosen" line: say this one replaces it
            why = ("no searched layout fits" if isinstance(found, LayoutError)
                   else f"faster than the table's {found[0]}")  # fmt: skip
            say(
                f"chosen instead: {layout} (uneven pipeline stages, padded: {why}), "
                f"predicted {best.time:.3g} s a step, {best.memory:,} bytes per device"
            )
        return layout
    layout = Layout(text) if text else default_layout(mesh)
    layout.check(mesh)
    layout.check_dims(model_dims(nm.trace(loss, params, batch, key)), f"the {name} model")
    return layout


def default_layout(mesh) -> Layout:
    """Data parallelism over every mesh axis of more than one device (`batch:rows,cols`);
    replicated on one device."""
    axes = tuple(a for a, n in mesh.sizes.items() if n > 1)
    return Layout({"batch": axes} if axes else {})


def train(args) -> int:
    """Train as the flags say; the exit status (EXIT_DONE, EXIT_PREEMPTED). Raises
    UsageError, DivergedError and the typed errors of the files it reads."""
    # several processes: a lost or hung peer ends this one (exit 75) at the next bound
    with Watchdog(args.step_timeout, enabled=jax.process_count() > 1) as dog:
        return _train(args, dog)


def _train(args, dog) -> int:
    model, cfg, tokenizer, corpus, mesh, layout, trainer, report, schedule = setup(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    say = cluster.say
    if jax.process_count() > 1:
        say(cluster.describe(mesh))
    total, trained = _count(trainer), _count(trainer, trained=True)
    say(f"model {args.model} ({args.config}): {total:,} parameters, {trained:,} trainable "
        f"({100 * trained / total:.2f}%); tokenizer {args.tokenizer}, "
        f"{tokenizer.vocab_size} ids")  # fmt: skip
    how = "" if args.layout else " (the default: data parallel over the mesh)"
    say(f"mesh {mesh} on {jax.devices()[0].platform}; layout {layout}{how}")
    say(f"{attention_settings(cfg)}; remat {cfg.remat}; "
        f"dtype {cfg.dtype}")  # fmt: skip
    if note := warmup_note(args.steps, args.warmup, args.lr, args.schedule):
        say(note)
    say("lowering report (forward and backward pass, per step, per device):")
    say("    " + str(report).replace("\n", "\n    "))
    dog.expect(COMPILE_S, "the processes' agreement and the checkpoint's restore")
    agree.check(
        **cluster.flags(args),  # every flag of the parser, each by name
        config=cfg,
        mesh=mesh.sizes,
        layout=str(layout),
        inputs=_shapes(trainer.abstract_inputs()),
        step=checkpoint.all_steps(out)[:1] if args.resume else [],
    )
    params = None
    if args.init_from and not args.resume:
        params, what = init_from.weights(args, mesh, layout)
        params = lora.completed(params, trainer.shapes, args.seed)  # + fresh adapters
        print(f"initialised from {what}")
    state = trainer.init_state(params)
    metrics_path = out / "metrics.jsonl"
    start = 0
    skipped = 0
    if args.resume:
        state, meta = checkpoint.restore_newest(out, state, say=_warn)
        start, skipped = meta["step"], meta.get("skipped", 0)
        if args.steps < start:  # (before the record or the log is touched)
            raise UsageError(
                f"--steps {args.steps}: the run in {out} is at step {start} already (its "
                f"newest checkpoint), past it; pass --steps {start} or more to go on"
            )
        history = []
        if writer():  # the log is process 0's alone: the others neither read nor warn
            logged = files.read_jsonl(metrics_path, _is_step_record)
            history = [r for r in logged if r["step"] <= start]
            files.rewrite_jsonl(metrics_path, history)  # a killed run may have logged more
            changes = dict(getattr(args, "record_changes", {}))  # flags given anew
            if getattr(args, "data_changed", False):  # --data given anew: the record follows
                changes |= _data_record(args)
            if changes:
                stored = files.read_json(out / "run.json", "the run's record")
                files.write_json(out / "run.json", {**stored, **changes})
        say(f"resumed from step {start} (checkpoint in {out}/checkpoints)")
    elif writer():
        run = record_of(args) | _data_record(args)
        if args.init_from:
            run["init_from"] = str(Path(args.init_from).absolute())
            if family := init_from.copy_base(args.init_from, out / hub.BASE):
                run["family"] = family
        files.write_json(out / "run.json", {**run, "vocab": cfg.vocab})
        tokenizer.save(out)
        history = []
    else:
        history = []
    ckpt = checkpoint.Checkpointer(out)
    meta = {"model": args.model, "config": args.config, "vocab": cfg.vocab, "skipped": skipped}
    # the last save ends under Preemption too: a SIGTERM while it is written waits for it
    # (the run is done), where the handler outside would end the process mid-save
    with Preemption() as preemption:
        try:
            at = Standing(state, start, history, meta)
            return _loop(args, corpus, trainer, schedule, at, Guards(ckpt, preemption, dog))
        finally:
            dog.expect(SAVE_S, "the last checkpoint's save")
            ckpt.close()


def _data_record(args) -> dict:
    """What run.json records of the data: --data and --val-data as absolute paths (a
    resume from another folder reads the same files) and their fingerprints
    (files.fingerprint: a resume that would read other data stops)."""
    paths = {k: getattr(args, k) for k in DATA_FLAGS}
    out = {k: v and str(Path(v).absolute()) for k, v in paths.items()}
    if args.tokenizer not in ("byte", "bpe") and Path(args.tokenizer).is_file():
        out["tokenizer"] = str(Path(args.tokenizer).absolute())
    return out | {"fingerprints": {k: files.fingerprint(v) for k, v in paths.items() if v}}


def _is_step_record(r) -> bool:
    """Whether a line of metrics.jsonl is what the loop writes: an object of numbers
    (and flags), its step a positive int and its loss a number."""
    number = lambda v: type(v) in (int, float)
    return (
        isinstance(r, dict) and type(r.get("step")) is int and r["step"] >= 1
        and number(r.get("loss")) and all(number(v) or type(v) is bool for v in r.values())
    )  # fmt: skip


@dataclasses.dataclass
class Standing:
    """Where a run stands as its loop begins: the train state, the last step done (0 on
    a fresh run), the metrics logged so far and the checkpoints' metadata."""

    state: dict
    start: int
    history: list
    meta: dict


@dataclasses.dataclass(frozen=True)
class Guards:
    """What stops or saves the loop: the checkpointer, the preemption signal and the
    watchdog that bounds each step of a multi-process run."""

    ckpt: checkpoint.Checkpointer
    preemption: Preemption
    dog: Watchdog


def _loop(args, corpus, trainer, schedule, at: Standing, guards: Guards):
    cfg, state, start, history = trainer.cfg, at.state, at.start, at.history
    ckpt, preemption, dog, meta = guards.ckpt, guards.preemption, guards.dog, at.meta
    out = Path(args.out)
    metrics_path = out / "metrics.jsonl"
    bar = _progress(args, start)
    board = _tensorboard(args) if writer() else None
    skipped = meta["skipped"]  # --skip-nonfinite's budget spans resumes
    evaluated = False  # the first validation compiles its program
    with open(metrics_path, "a") if writer() else _Discard() as log:
        last = time.perf_counter()
        for step in range(start + 1, args.steps + 1):
            dog.expect(dog.step_limit(), f"step {step}")
            batch = corpus.batch(step, cfg.batch, args.seed, trainer.local_rows())
            state, stats = trainer.update(state, batch, step)
            loss = stats["loss"]
            now = time.perf_counter()
            dog.step_done(now - last, compiled=step == start + 1)
            rec = {
                "step": step,
                "loss": loss,
                "grad_norm": stats["grad_norm"],
                # a skipped step leaves the optimizer's update count (the schedule's) as
                # it was: step s computes with the lr of update s - 1 - (skipped before it)
                "lr": float(schedule(step - 1 - skipped)),
                "tokens_per_s": cfg.batch * cfg.length / (now - last),
                **trainer.router_metrics(),
            }
            if not stats["finite"]:
                skipped += 1
                rec["skipped"] = True
            if step % args.eval_every == 0 or step == args.steps:
                limit = dog.step_limit() * (args.eval_batches + 1)
                dog.expect(
                    limit if evaluated else max(limit, COMPILE_S), f"step {step}'s validation"
                )
                evaluated = True
                val, _ = trainer.evaluate(
                    state, corpus.validation_batches(cfg.batch, args.eval_batches)
                )
                rec["val_loss"] = val
                rec["val_bits_per_byte"] = bits_per_byte(val, corpus.bytes_per_token())
                _note(
                    bar,
                    f"step {step}: loss {loss:.3f}, validation {val:.3f} nats/token, "
                    f"{rec['val_bits_per_byte']:.3f} bits/byte",
                )
            _disk(metrics_path, step, _append, log, rec)
            if not stats["finite"]:
                dog.expect(SAVE_S, f"step {step}'s newest save")  # _diverged may wait for it
                _diverged(args, bar, rec, skipped, ckpt)
            if board is not None:
                for k, v in rec.items():
                    if k not in ("step", "skipped"):
                        board.add_scalar(k, v, step)
            history.append(rec)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            bar.update(1)
            _check_saves(ckpt, step)  # a background save that failed stops the run here
            saved = step % args.save_every == 0 or step == args.steps
            dog.expect(dog.step_limit() + SAVE_S * saved, f"step {step}'s save")
            stop = step < args.steps and preemption.should_stop()
            if saved or stop:
                _save(ckpt, step, state, {**meta, "skipped": skipped}, stop)
                if writer():
                    _disk(out / "loss.png", step, plot, history, out / "loss.png")
            if stop:
                bar.close()
                cluster.say(
                    f"stopped by {preemption.signal.name if preemption.signal else 'a peer'} "
                    f"after step {step}: saved a checkpoint in {out / 'checkpoints'}; "
                    "continue with the same command and --resume"
                )
                return EXIT_PREEMPTED
            last = time.perf_counter()  # evaluations and saves are not step time
    bar.close()
    if board is not None:
        board.close()
    cluster.say(
        f"wrote {metrics_path}, {out / 'loss.png'} and checkpoints in {out / 'checkpoints'}"
    )
    return EXIT_DONE


def _append(log, rec: dict) -> None:
    log.write(json.dumps(rec) + "\n")
    log.flush()


def _disk(path: Path, step: int, write, *args) -> None:
    """`write(*args)`, which writes `path`; a full or read-only disk stops the run as a
    failed save does."""
    try:
        write(*args)
    except OSError as e:
        raise checkpoint.SaveFailedError(
            f"{path} could not be written ({e.strerror or e}); the run stopped after step {step}"
        ) from None


def _check_saves(ckpt, step: int) -> None:
    _save(ckpt, step, None, None, wait=False)


def _save(ckpt, step: int, state, meta: dict | None, wait: bool) -> None:
    """Save `state` at `step` (None: only check that the background saves went well),
    and wait for it; a failed save, of this step or an earlier one, says where the run
    stopped."""
    try:
        if state is None:
            ckpt.check()
            return
        ckpt.save(step, state, meta)
        if wait:
            ckpt.wait()
    except checkpoint.NonFiniteError as e:  # the step's checks passed, the state did not
        raise DivergedError(f"{e}; the newest checkpoint is the last finite state") from None
    except checkpoint.SaveFailedError as e:
        raise checkpoint.SaveFailedError(f"{e}; the run stopped after step {step}") from None


def _diverged(args, bar, rec: dict, skipped: int, ckpt) -> None:
    """Say that step rec["step"] was not applied; DivergedError past --skip-nonfinite."""
    what = f"step {rec['step']}: loss {rec['loss']}, gradient norm {rec['grad_norm']}"
    if skipped <= args.skip_nonfinite:
        _note(bar, f"{what}: not finite, update skipped ({skipped} of --skip-nonfinite "
                  f"{args.skip_nonfinite})")  # fmt: skip
        return
    ckpt.wait()  # the newest save finished, so it is listed
    newest = checkpoint.all_steps(args.out)[:1]
    where = f"the newest checkpoint is step {newest[0]}" if newest else "no checkpoint was saved"
    raise DivergedError(
        f"{what}: not finite; the update was not applied and the run stops ({where}; "
        f"--skip-nonfinite N skips up to N such steps)"
    )


def _shapes(tree):
    """dims and shape of every Tensor of a pytree (what processes compare)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nm.Tensor))
    return [[list(t.dims), list(t.shape)] for t in leaves]


def _count(trainer, trained: bool = False) -> int:
    """The model's parameters; with `trained`, those the run trains."""
    params = trainer.abstract_inputs()[0]
    if trained:
        params = trainable.split(params, trainer.trained)[0]
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, nm.Tensor))
    return sum(int(np.prod(t.shape)) for t in leaves)


def _warn(message: str) -> None:
    """A warning on stderr from process 0 only (every process restores the same
    checkpoint and would say the same)."""
    if writer():
        print(message, file=sys.stderr, flush=True)


def _tensorboard(args):
    """A tensorboardX SummaryWriter on --tensorboard DIR (one scalar per metric per
    step, tagged as in metrics.jsonl), or None."""
    if not getattr(args, "tensorboard", None):
        return None
    from tensorboardX import SummaryWriter

    return SummaryWriter(args.tensorboard)


def _progress(args, start):
    from tqdm import tqdm

    return tqdm(
        total=args.steps,
        initial=start,
        disable=args.quiet or not writer(),
        unit="step",
        dynamic_ncols=True,
    )


def _note(bar, text: str) -> None:
    """A line above the progress bar, from process 0 alone."""
    if writer():
        bar.write(text)


class _Discard:
    """The metrics log of a process that does not write it (all but process 0)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def plot(history: list[dict], path: Path) -> None:
    """Train loss per step and validation loss where measured, in nats per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], label="train", lw=1)
    val = [r for r in history if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files.write_with(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
