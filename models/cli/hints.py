"""transformers' flag names on every `namedmesh` subcommand (models.cli.train.Parser).

One rule: transformers' (Trainer's, `generate`'s, the HF example scripts') name of a
setting is an alias of ours when it takes the same value in the same unit
(`--learning-rate 3e-4` is `--lr 3e-4`: ALIASES); where theirs means something else
(epochs where we count steps, a per-device batch where ours is global) it is unknown,
and the error names our flag and how it differs (THEIRS). Underscores read as dashes
(`--learning_rate`, as HfArgumentParser takes both). Any other unknown flag gets the
command's closest flag by spelling (difflib).
"""

from __future__ import annotations

import argparse
import difflib

from models.io.source import SOURCE

# transformers' name -> ours, where both take the same value for the same setting
ALIASES = {
    "--learning-rate": "--lr",
    "--output-dir": "--out",
    "--max-new-tokens": "--max-new",
    "--max-steps": "--steps",
    "--gradient-accumulation-steps": "--grad-accum",
    "--warmup-steps": "--warmup",
    "--adam-epsilon": "--eps",
    "--max-grad-norm": "--clip",
    "--save-steps": "--save-every",
    "--eval-steps": "--eval-every",
    "--train-file": "--data",
    "--validation-file": "--val-data",
    "--block-size": "--length",
    "--max-seq-length": "--length",
}

# transformers' name of a setting ours holds differently -> (our flag, how it differs),
# in order: a command offers the first it has (--model-name-or-path is train's
# --init-from, generate's SOURCE)
THEIRS = {
    "--num-train-epochs": (("--steps", "optimizer steps in all: there are no epochs"),),
    "--per-device-train-batch-size": (("--batch", "the global batch, split over the mesh"),),
    "--per-device-eval-batch-size": (("--batch", "the global batch, split over the mesh"),),
    "--train-batch-size": (("--batch", ""),),
    "--batch-size": (("--batch", ""),),
    "--model-name-or-path": (
        ("--init-from", "a local Hugging Face folder"),
        (SOURCE, "the positional argument: a run or a local Hugging Face folder"),
    ),
    "--max-length": (("--length", "tokens per sequence"),),
    "--num-train-steps": (("--steps", ""),),
    "--seq-length": (("--length", ""),),
    "--lr-scheduler-type": (("--schedule", "cosine, linear, constant or wsd"),),
    "--optim": (("--optimizer", "adamw, adafactor, lion or sgd"),),
    "--adam-beta1": (("--betas", "B1,B2 together"),),
    "--adam-beta2": (("--betas", "B1,B2 together"),),
    "--logging-dir": (("--tensorboard", ""),),
    "--resume-from-checkpoint": (("--resume", "continues the run in --out"),),
    "--dataset-name": (("--data", "a local file or folder"),),
    "--bf16": (("--dtype", "--dtype bfloat16"),),
    "--fp16": (("--dtype", "float32 or bfloat16"),),
    "--torch-dtype": (("--dtype", ""),),
}


def aliases(names) -> list[str]:
    """transformers' names of the flag named `names` (ALIASES), to add to it."""
    return [theirs for theirs, ours in ALIASES.items() if ours in names]


def dashed(argv: list[str], flags: set[str]) -> list[str]:
    """`argv` with each `--a_b` (or `--a_b=v`) that is not a flag but whose dashed form
    is written `--a-b`, up to a `--` (after it, all are positionals)."""
    out = list(argv)
    for i, token in enumerate(out):
        if token == "--":
            break
        name, eq, value = token.partition("=")
        fixed = "--" + name[2:].replace("_", "-")
        if token.startswith("--") and name not in flags and fixed in flags:
            out[i] = fixed + eq + value
    return out


def offered(actions: list[argparse.Action]) -> list[str]:
    """The names a command offers for hints: its flags shown in --help (not an older
    spelling kept working), and SOURCE when it takes one."""
    flags = [s for a in actions if a.help != argparse.SUPPRESS for s in a.option_strings]
    return flags + [SOURCE] * any(a.metavar == SOURCE for a in actions if not a.option_strings)


def hint(unknown: str, options: list[str]) -> str | None:
    """`OURS for UNKNOWN`, OURS being ours for transformers' name (THEIRS, then how it
    differs) when `options` (the command's flags) hold it, else the closest of `options`
    by spelling; None when none is close."""
    name = unknown.partition("=")[0]
    spelled = "--" + name.lstrip("-").replace("_", "-")
    for ours, note in THEIRS.get(spelled, ()):
        if ours in options:
            return f"{ours} for {name}" + (f" ({note})" if note else "")
    close = difflib.get_close_matches(spelled, options, n=1, cutoff=0.7)
    return f"{ALIASES.get(close[0], close[0])} for {name}" if close else None  # ours, not theirs


def explained(message: str, options: list[str]) -> str:
    """argparse's `unrecognized arguments: ...` message with a did-you-mean for each
    unknown flag that has one; other messages as they are."""
    head = "unrecognized arguments: "
    if not message.startswith(head):
        return message
    said = [hint(t, options) for t in message[len(head) :].split() if t.startswith("-")]
    said = [s for s in said if s]
    return f"{message}: did you mean {', '.join(said)}?" if said else message
