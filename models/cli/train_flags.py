"""The flags of `python -m models.cli.train` (`parser()`, `arguments`) and their checks
(RANGES, `check_ranges`, `optimizer_fault`, `init_fault`), which the other subcommands
share (`Parser`, `Range`, CLUSTER_RANGES, `parse_mesh`). Apart from the command
(models/cli/train.py) so that the training run (models/training/run.py), which checks and records
these flags, does not import the command that runs it (issue 42); models.cli.train
re-exports them."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NamedTuple

from models.cli import cluster, settings

MAX_DEVICES = 1 << 16  # devices of a mesh, at most: more than any machine holds


def parse_mesh(text: str) -> dict[str, int]:
    """ "rows=2,cols=4" -> {"rows": 2, "cols": 4}. An axis is named by an ASCII
    identifier (lowering.mesh.check_axis_name, as Mesh holds it) and sized 1 to MAX_DEVICES."""
    from lowering.mesh import check_axis_name  # (jax: imported once the flags are read)
    from namedmesh.errors import MeshError

    out = {}
    for part in text.split(","):
        name, eq, size = (s.strip() for s in part.partition("="))
        if not eq or not name or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"--mesh {text!r}: expected axis=size pairs separated by commas, e.g. rows=2,cols=4"
            )
        try:
            check_axis_name(name)
        except MeshError as e:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: {e}") from None
        if name in out:
            raise argparse.ArgumentTypeError(f"--mesh {text!r}: axis {name!r} given twice")
        out[name] = int(size)
    if math.prod(out.values()) > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: {math.prod(out.values()):,} devices, more than {MAX_DEVICES:,}"
        )
    return out


def parse_betas(text: str) -> tuple[float, ...]:
    """ "0.9,0.98" -> (0.9, 0.98): one or two decays, each 0 <= b < 1."""
    try:
        out = tuple(float(b) for b in text.split(","))
    except ValueError:
        out = ()
    if not out or len(out) > 2 or not all(0 <= b < 1 for b in out):
        raise argparse.ArgumentTypeError(
            f"--betas {text!r}: expected one or two numbers 0 <= b < 1, e.g. 0.9,0.98"
        )
    return out


def parse_chat_date(text: str) -> str:
    """ "2026-12-06" (ISO) or "none" -> itself: the date chat templates' strftime_now
    renders for a run's data (models/training/chat.py)."""
    import datetime

    if text == "none":
        return text
    try:
        return datetime.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--chat-date {text!r}: expected a date YYYY-MM-DD, or none"
        ) from None


# The schedule of a run from scratch, and of a fine-tune (--init-from): transformers'
# Trainer's (lr 5e-5, linear decay to 0, no warmup, no weight decay, Adam's betas), as
# a fine-tune starts from a trained minimum that a from-scratch lr (3e-3) throws away.
SCRATCH = {"lr": 3e-3, "schedule": "cosine", "warmup": 50}
FINETUNE = {"lr": 5e-5, "schedule": "linear", "warmup": 0, "min_lr": 0.0, "weight_decay": 0.0}
FINETUNE_ADAMW_BETAS = (0.9, 0.999)
# A LoRA run's peak learning rate: its adapters start at zero and train alone (QLoRA's and
# torchtune's LoRA recipes use 1e-4 to 3e-4), far above a full fine-tune's 5e-5.
LORA_LR = 2e-4
LORA_FLAGS = ("lora_alpha", "lora_dropout", "lora_targets")  # they need --lora-rank


def training_defaults(args: argparse.Namespace) -> None:
    """Fill the optimizer flags left None with a run's (SCRATCH) or a fine-tune's
    (FINETUNE) defaults; the optimizer's own (models/training/optim.py) fill the rest."""
    fine = bool(getattr(args, "init_from", None))
    if getattr(args, "lora_rank", None) and args.lr is None:
        args.lr = LORA_LR
    for k, v in (FINETUNE if fine else SCRATCH).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if fine and args.optimizer == "adamw" and args.betas is None:
        args.betas = FINETUNE_ADAMW_BETAS
    if getattr(args, "chat_date", "none") is None:  # the day the run starts, recorded
        import datetime

        args.chat_date = datetime.date.today().isoformat()


class Range(NamedTuple):
    """The values a numeric flag takes: low <= value (low < value when `open_low`),
    value <= high when high is given; floats must be finite."""

    low: float
    high: float | None = None
    open_low: bool = False

    def holds(self, value) -> bool:
        if not math.isfinite(value) or (value <= self.low if self.open_low else value < self.low):
            return False
        return self.high is None or value <= self.high

    def __str__(self) -> str:
        low = f"> {self.low}" if self.open_low else f">= {self.low}"
        return low if self.high is None else f"{low} and <= {self.high}"


# A count (of steps, tokens, ids...) at most: the step counter is an int32 and optax's
# schedule counts to warmup + 1 in one, and no tokenizer, batch or sequence is larger.
COUNT = 10**9

# The joining flags every subcommand takes (models/cli/cluster.py checks the id against the
# count)
CLUSTER_RANGES = {"num_processes": Range(1, MAX_DEVICES), "process_id": Range(0, MAX_DEVICES)}

# Every numeric flag's allowed values, checked before anything is read or compiled (None
# values mean "the config's" and are not checked).
RANGES = {
    "steps": Range(1, COUNT),
    "batch": Range(1, COUNT),
    "length": Range(1, COUNT),
    "seed": Range(0, 2**32 - 1),
    "bpe_vocab": Range(257, COUNT),  # the 256 bytes and at least one merge
    "lr": Range(0, open_low=True),
    "warmup": Range(0, COUNT),
    "min_lr": Range(0),
    "weight_decay": Range(0),
    "eps": Range(0, open_low=True),
    "clip": Range(0),  # 0: no clipping
    "dropout": Range(0, 1, open_low=False),
    "attention_block": Range(1, COUNT),
    "grad_accum": Range(1, COUNT),
    "eval_every": Range(1, COUNT),
    "eval_batches": Range(1, COUNT),
    "save_every": Range(1, COUNT),
    "skip_nonfinite": Range(0, COUNT),
    "step_timeout": Range(0, open_low=True),
    "lora_rank": Range(1, COUNT),
    "lora_alpha": Range(0, open_low=True),
    "lora_dropout": Range(0, 0.99),
    "step": Range(0, COUNT),
    **CLUSTER_RANGES,
}

# Config fields that a flag sets: `--set FIELD=` beside the flag is refused (which
# would win?), and `vocab` is always the tokenizer's (padded; models/training/data.py).
SET_BY_FLAGS = ("batch", "length", "dropout", "dtype", "remat", "attention", "attention_block")


# Config fields a fine-tune (--init-from) may `--set`: how it trains, not what the
# folder's weights are (every other field is the folder's architecture)
FINETUNE_FIELDS = ("length", "batch", "dropout", "dtype", "remat", "attention",
                   "attention_block", "scan_layers", "capacity_factor", "moe_loss")  # fmt: skip


def check_ranges(args: argparse.Namespace, ranges: dict[str, Range] = RANGES) -> str | None:
    """The one-line complaint about the first flag outside its range, or about a
    `--set` of a field that a flag or the tokenizer sets, or, with --init-from, of the
    folder's architecture; None when all hold."""
    for name, allowed in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not allowed.holds(value):
            return f"--{name.replace('_', '-')} {value}: must be {allowed}"
    if not getattr(args, "lora_rank", None):
        for name in LORA_FLAGS:
            if getattr(args, name, None) is not None:
                flag = f"--{name.replace('_', '-')} {getattr(args, name)}"
                return f"{flag}: a LoRA flag, with no --lora-rank R to turn LoRA on"
    for item in getattr(args, "set", None) or []:
        field = item.partition("=")[0].strip()
        if field == "vocab":
            return f"--set {item}: the vocabulary is the tokenizer's (--tokenizer, --bpe-vocab)"
        if getattr(args, "init_from", None) and field not in FINETUNE_FIELDS:
            return (
                f"--set {item}: {field} is the architecture of --init-from "
                f"{args.init_from}, whose weights a fine-tune keeps; a fine-tune may set "
                f"{', '.join(FINETUNE_FIELDS)}"
            )
        if field in SET_BY_FLAGS and getattr(args, field, None) is not None:
            flag = f"--{field.replace('_', '-')}"
            return f"--set {item}: {flag} {getattr(args, field)} sets it too; give one of them"
    return None


def optimizer_fault(args: argparse.Namespace) -> str | None:
    """The one-line complaint about an optimizer flag the optimizer takes no use of
    (--betas or --eps of one without them, --decay without weight decay), or a
    schedule flag that cannot work: a --min-lr on the command line of the constant
    schedule (which never decays: it would be ignored) or above the peak --lr (the
    "decay" would raise the learning rate); or None."""
    from models.training.optim import settings as optimizer_settings

    try:
        decay = optimizer_settings(args.optimizer, args.weight_decay, args.betas, args.eps)
    except ValueError as e:
        return str(e)
    given = getattr(args, "given", ())  # the command line's: --decay a run.json records
    if getattr(args, "decay", None) and "decay" in given and not decay["weight_decay"]:
        return (
            f"--decay {args.decay}: {args.optimizer} decays no parameter here (weight decay "
            "0): pass --weight-decay too"
        )
    schedule, lr, end = args.schedule, args.lr, args.min_lr
    # (the command line's alone: a run.json given as --config-file records every flag)
    if schedule == "constant" and end is not None and "min_lr" in getattr(args, "given", ()):
        return f"--min-lr {end}: the constant schedule stays at --lr {lr}, it has no end lr"
    if end is not None and lr is not None and end > lr:
        return (
            f"--min-lr {end}: above --lr {lr}, the peak: the {schedule} schedule would "
            "raise the learning rate after the warmup, not decay it"
        )
    return None


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with every flag's default, but one whose help already says its
    default in words (`(default: searched)`) shows that alone, not `(default: None)`
    after it."""

    def _get_help_string(self, action):  # argparse's documented hook for this formatter
        text = action.help or ""
        return text if "(default: " in text else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage dump), still with exit status 2; a
    flag also answers to transformers' name of the same setting (--learning-rate for
    --lr) and to underscores for dashes (--max_new); an unknown flag gets a did-you-mean
    (models/cli/hints.py: by spelling, or transformers' name of a setting that differs)."""

    def add_argument(self, *names, **kwargs):
        from models.cli.hints import aliases

        return super().add_argument(*names, *aliases(names), **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        from models.cli.hints import dashed

        flags = {s for a in self._actions for s in a.option_strings}  # argparse's list
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(dashed(argv, flags), namespace)

    def error(self, message: str):
        from models.cli.hints import explained, offered

        message = explained(message, offered(self._actions))  # argparse's list of flags
        self.exit(2, f"{self.prog.removeprefix('python -m ')}: error: {message} (see --help)\n")


def arguments(argv=None, prog: str = "python -m models.cli.train") -> argparse.Namespace:
    """The flags of `argv` (over the settings of --config-file), each numeric one
    checked against RANGES (exit 2 if not)."""
    p = parser(prog)
    args = settings.parse(p, argv)
    args.given = tuple(sorted(explicit(parser(prog), argv)))
    # the flags --config-file sets: a --resume holds them to the record as it holds
    # `given` (models/training/run.py), never letting the record override them unsaid
    argv = sys.argv[1:] if argv is None else argv
    args.filed = tuple(sorted(settings.in_file(parser(prog), argv)))
    training_defaults(args)
    complaint = check_ranges(args) or optimizer_fault(args) or init_fault(args)
    if complaint:
        p.error(complaint)
    return args


def init_fault(args: argparse.Namespace) -> str | None:
    """The one-line complaint about --step without --init-from (a --resume's is checked
    against its record, models/training/run.py), or None."""
    if args.step is None or args.init_from or args.resume:
        return None
    return (
        f"--step {args.step}: picks the checkpoint of the run --init-from RUN starts from, "
        "and there is no --init-from (--steps N: how many steps to train; --resume "
        "continues a run from its own newest checkpoint)"
    )


def explicit(p: argparse.ArgumentParser, argv=None) -> set[str]:
    """The flags (their `dest`s) given on the command line `argv` itself, not left at
    their defaults nor read from --config-file: `p` parses argv with every default
    suppressed (`p` is changed: pass a fresh one; argv is known to parse)."""
    for action in p._actions:  # argparse's list of the parser's flags
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_known_args(sys.argv[1:] if argv is None else argv)[0]))


def parser(prog: str = "python -m models.cli.train") -> Parser:
    p = Parser(
        prog=prog,
        description=__doc__.split("\n")[0],
        formatter_class=Defaults,  # every flag shows its default
    )
    p.add_argument("--model", default="lm", help="the model: lm, moe, bert or encdec")
    p.add_argument(
        "--config",
        default="tiny",
        help="its config: tiny, small, base, lm1b_m1 ... lm1b_5, the published shapes (gpt2, "
        "llama3-8b, t5-small...); `--config list` lists them all with their sizes",
    )
    p.add_argument(
        "--mesh",
        type=parse_mesh,
        default={"data": 1},
        help="mesh axes and sizes, e.g. rows=2,cols=4",
    )
    p.add_argument(
        "--layout",
        default="",
        help='rules like "batch:rows;d_ff:cols", or auto; empty: batch over every mesh axis',
    )
    p.add_argument(
        "--rates",
        default=None,
        help="--layout auto: weigh at a hardware's rates (tpu_v2, tpu_v3, tpu_v4, tpu_v5e, "
        "a100, h100), optionally changed (tpu_v4,latency=2e-5), or at figures of your own "
        "(flops=1e12,bandwidth=1e10,latency=1e-5[,memory=8e9]; SI units); default: measured "
        "on the mesh's devices",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps in all")
    p.add_argument("--out", default="runs/run", help="folder for metrics, checkpoints, plot")
    p.add_argument("--data", default=None, help="a text file or folder; None: Python's docs")
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="byte, bpe (trained on the data), or a tokenizer.json file to load",
    )
    p.add_argument("--bpe-vocab", type=int, default=1024, help="vocabulary of a trained bpe")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (None: config's)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (None: config's)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "adafactor", "lion", "sgd"],
        help="optax's",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (None: see below)")
    p.add_argument(
        "--schedule",
        default=None,
        choices=["cosine", "linear", "constant", "wsd"],
        help="after the warmup: decay to --min-lr (cosine, linear; wsd: over the last fifth "
        "of the steps) or none (constant)",
    )
    p.add_argument("--warmup", type=int, default=None, help="steps of linear warmup from 0")
    p.add_argument("--min-lr", type=float, default=None, help="the last step's (None: lr/10)")
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="decoupled (adamw, lion, adafactor) or L2 (sgd); None: adamw 0.01, lion 0.1, else 0",
    )
    p.add_argument(
        "--decay",
        default=None,
        choices=["matrices", "all"],
        help="the parameters weight decay pulls to 0: matrices (not biases nor norm scales: "
        "Hugging Face's Trainer's choice) or all; None: matrices (a run recorded without "
        "--decay resumes with all)",
    )
    p.add_argument(
        "--betas",
        type=parse_betas,
        default=None,
        metavar="B1,B2",
        help="adamw's and lion's moment decays, sgd's momentum (one); None: adamw 0.9,0.98, "
        "lion 0.9,0.99, sgd 0",
    )
    p.add_argument("--eps", type=float, default=None, help="adamw's epsilon (None: 1e-8)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--dropout", type=float, default=None, help="rate (None: config's)")
    p.add_argument("--seed", type=int, default=0, help="of parameters, data order, dropout")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="compute dtype of matmuls and activations (parameters stay float32)",
    )
    p.add_argument(
        "--remat",
        default=None,
        choices=["none", "full", "dots"],
        help="what the backward pass keeps of each layer: all, only its input, or matmuls",
    )
    p.add_argument(
        "--attention",
        default=None,
        # "auto" and models.layers.kernels.KERNELS (jax not imported yet)
        choices=["auto", "full", "blockwise", "ring", "fused"],
        help="attention kernel of models/layers/kernels.py, or auto: by length (None: config's)",
    )
    p.add_argument("--attention-block", type=int, default=None, help="keys per block")
    p.add_argument(
        "--grad-accum", type=int, default=1, help="microbatches per step (batch divides by it)"
    )
    p.add_argument("--eval-every", type=int, default=100, help="steps between validations")
    p.add_argument("--eval-batches", type=int, default=8, help="batches per validation")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        metavar="S",
        help="several processes: a step (or validation, save) not ended in S seconds means a "
        "lost or hung peer: exit 75 (None: 10 x the slowest step, >= 10 s)",
    )
    p.add_argument(
        "--skip-nonfinite",
        type=int,
        default=0,
        metavar="N",
        help="skip up to N steps whose loss or gradient norm is not finite (their update is "
        "not applied) before stopping; 0: stop at the first",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="SOURCE",
        help="fine-tune a Hugging Face folder (gpt2, llama) or a training run's --out folder: "
        "its config, weights, tokenizer",
    )
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="--init-from a run: its checkpoint at this step (None: its latest)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    # --- LoRA and frozen weights (models/layers/lora.py, models/training/trainable.py;
    # docs/lora.md) ---
    p.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="train LoRA adapters of rank R (a named dim `lora`) instead of the weights, "
        "which stay frozen; lr defaults to 2e-4",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        default=None,
        help="the adapters' update is scaled by alpha / R, as PEFT's (None: 8, PEFT's default)",
    )
    p.add_argument(
        "--lora-dropout",
        type=float,
        default=None,
        help="dropout on the adapters' input while training (None: 0)",
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="the projections adapted, of q,k,v,o (attention) and gate,up,down (the FFN) "
        "(None: q,v, PEFT's default for Llama)",
    )
    p.add_argument(
        "--freeze",
        action="append",
        metavar="PATTERN",
        help="leave the parameters whose path (layers/attn/q, embed) matches this glob or "
        "regular expression untrained (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        help="override a model Config field (repeatable), e.g. --set d_model=128",
    )
    p.add_argument("--tensorboard", metavar="DIR", help="also write metrics as TensorBoard events")
    # --- data formats and config files (models/training/datasets.py, models/cli/settings.py) ---
    p.add_argument(
        "--val-data",
        default=None,
        help="a validation set apart from --data, of any kind --data takes (None: the last "
        "tenth of --data)",
    )
    p.add_argument(
        "--text-field", default="text", help="the field of the documents in JSON lines/Parquet"
    )
    p.add_argument(
        "--data-format",
        default="auto",
        choices=["auto", "text", "chat"],  # models.training.data.FORMATS (jax not imported yet)
        help="chat: JSON lines of messages, the loss on the assistant's tokens, "
        "packed (docs/chat.md); auto: chat when the first line has `messages`",
    )
    p.add_argument(
        "--chat-date",
        type=parse_chat_date,
        default=None,
        metavar="YYYY-MM-DD",
        help="the date chat templates' strftime_now renders (Llama 3.x write it into the "
        "system turn); none: as if the template had no clock; None: the day the run starts, "
        "recorded in run.json so that a resume on another day renders the same tokens",
    )
    p.add_argument(
        "--config-file",
        default=None,
        metavar="FILE",
        help="start from the settings of a JSON or YAML file (a run's run.json); flags given "
        "on the command line override it",
    )
    cluster.add_flags(p)
    return p
