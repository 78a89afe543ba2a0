"""Did-you-mean for an unknown flag of any `namedmesh` subcommand (models.train.Parser):
the closest flag of the command by spelling (difflib), or, for the names transformers'
Trainer, `generate` and the HF example scripts give the same setting, ours."""

from __future__ import annotations

import difflib

# transformers' (and its example scripts') flag -> the flags that mean it here, in order
# (a command offers the first it has: --model-name-or-path is train's --init-from,
# generate's --checkpoint)
THEIRS = {
    "--learning-rate": ("--lr",),
    "--output-dir": ("--out",),
    "--max-new-tokens": ("--max-new",),
    "--max-length": ("--max-length", "--length"),
    "--max-steps": ("--steps",),
    "--num-train-steps": ("--steps",),
    "--per-device-train-batch-size": ("--batch",),
    "--per-device-eval-batch-size": ("--batch",),
    "--train-batch-size": ("--batch",),
    "--batch-size": ("--batch",),
    "--gradient-accumulation-steps": ("--grad-accum",),
    "--warmup-steps": ("--warmup",),
    "--lr-scheduler-type": ("--schedule",),
    "--optim": ("--optimizer",),
    "--adam-beta1": ("--betas",),
    "--adam-beta2": ("--betas",),
    "--adam-epsilon": ("--eps",),
    "--max-grad-norm": ("--clip",),
    "--save-steps": ("--save-every",),
    "--eval-steps": ("--eval-every",),
    "--logging-dir": ("--tensorboard",),
    "--resume-from-checkpoint": ("--resume",),
    "--model-name-or-path": ("--init-from", "--checkpoint", "--model"),
    "--train-file": ("--data",),
    "--dataset-name": ("--data",),
    "--validation-file": ("--val-data",),
    "--block-size": ("--length",),
    "--max-seq-length": ("--length",),
    "--seq-length": ("--length",),
    "--bf16": ("--dtype",),
    "--fp16": ("--dtype",),
    "--torch-dtype": ("--dtype",),
}


def hint(unknown: str, options: list[str]) -> str | None:
    """`--lr` for `--learning-rate` (or `--learning_rate`) when `options` (the command's
    flags) hold it; else the closest of `options` by spelling; None when none is close."""
    name = unknown.partition("=")[0]
    spelled = "--" + name.lstrip("-").replace("_", "-")
    if spelled in options and spelled != name:
        return spelled
    for ours in THEIRS.get(spelled, ()):
        if ours in options:
            return ours
    close = difflib.get_close_matches(spelled, options, n=1, cutoff=0.7)
    return close[0] if close else None


def explained(message: str, options: list[str]) -> str:
    """argparse's `unrecognized arguments: ...` message with a did-you-mean for each
    unknown flag that has one; other messages as they are."""
    head = "unrecognized arguments: "
    if not message.startswith(head):
        return message
    said = []
    for token in message[len(head) :].split():
        found = token.startswith("-") and hint(token, options)
        if found:
            said.append(f"{found} for {token.partition('=')[0]}")
    return f"{message}: did you mean {', '.join(said)}?" if said else message
