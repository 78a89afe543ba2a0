"""`namedmesh generate SOURCE`: continue prompts with a decoder LM, or decode T5 inputs.

    namedmesh generate runs/tiny --prompt "The assert statement" \\
        --mode greedy|sample|beam --max-new 200
    namedmesh generate runs/tiny --step 200 --prompts prompts.txt --mode sample \\
        --temperature 0.8 --top-k 40 --top-p 0.9 --eos 10 --max-length 64
    namedmesh generate path/to/instruct --chat --prompt "Hi" \\
        --mesh data=1,model=4 --layout "heads:model;d_ff:model"
    namedmesh generate runs/tiny --prompt "The" --stream --stop $'\\n\\n'
    namedmesh generate runs/tiny --prompts prompts.txt --jsonl --stop "."

SOURCE is a training run's --out folder (its latest checkpoint, or --step's) or a
Hugging Face folder, as every subcommand takes it (models/io/source.py; `--checkpoint
SOURCE` is the older spelling, still read).

The prompts (one per line of --prompts) decode as one batch: one forward pass over
the right-padded prompts fills a KV cache of --max-length slots per layer (prefill),
then each step feeds every row's newest token at that row's own position. A row stops
at the --eos token or at --max-length tokens (prompt included) and emits --eos from
then on (a single --prompt without --max-length instead goes on past the cache: its
last half is written into a fresh cache). Greedy takes the likeliest token; sample
draws from softmax(logits / T) restricted to the --top-k likeliest tokens and the
--top-p nucleus; beam (one prompt) keeps the --beams likeliest continuations. A T5
folder encodes each prompt once and decodes from its decoder start token,
cross-attending to the encoding.

Output: each prompt and its continuation, a blank line between continuations; --stop
TEXT (repeatable) ends a row at the first occurrence of any, cut from its text; --jsonl
prints one object per prompt (prompt, text, tokens, finish_reason: stop, eos or
length); --stream prints one prompt's text as it is decoded (models/inference/continuations.py
holds back what is not final). `continue_prompts` is the decoding both this command
and `models.load(...).generate` (models/inference/api.py) run.

A Hugging Face folder (or a run fine-tuned from one, which keeps the base's files in
OUT/base) brings its tokenizer, its EOS ids (generation_config.json, config.json: the
default --eos; a row ends at any of them) and its chat template (--chat renders the
prompt as one user turn of it), as models/io/folder_tokens.py reads them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import jax

from lowering import Mesh
from models import zoo
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
from models.inference.continuations import Continuations, check_stops
from models.inference.decoding import MODES, Decoder, decode_step, init_cache, prefill_step
from models.inference.sampling import Sampling
from models.io import files, folder_tokens, hub
from models.io.source import add_source, is_run, need_checkpoint, no_steps, read_run, resolve
from models.training import checkpoint, data
from namedmesh.errors import ParameterError

__all__ = [
    "Decoder",
    "decode_step",
    "init_cache",
    "prefill_step",
    "load",
    "continue_prompts",
    "end_ids",
    "main",
]


def load(run: str | Path, step: int | None = None, merge: bool = True):
    """(params, cfg, tokenizer) of a training run's checkpoint at `step` (the latest by
    default), or of a Hugging Face folder (config.json, safetensors, a tokenizer) of a
    decoder LM. A LoRA run's adapters are merged into its weights (models/layers/lora.py),
    unless `merge` is False: then they are there beside them."""
    run = Path(run)
    if (run / "config.json").exists() and not is_run(run):
        if step is not None:
            raise no_steps(run, step)
        return load_hub(run)
    need_checkpoint(run)
    flags = files.read_json(run / "run.json", "the run's record")
    if zoo.get(flags["model"]).objective != "lm":
        raise checkpoint.CheckpointError(
            f"{run} holds a {flags['model']!r} model; generation needs a decoder LM (lm, moe)"
        )
    return read_run(run, step, merge)[1:]


def base_folder(run: str | Path) -> Path | None:
    """The folder whose config.json and tokenizer files describe `run`'s model: a
    Hugging Face folder itself, a fine-tune's OUT/base; None for a zoo run."""
    run = Path(run)
    if (run / "config.json").exists() and not (run / "run.json").exists():
        return run
    return run / hub.BASE if (run / hub.BASE / "config.json").exists() else None


def load_hub(folder: Path):
    """(params, cfg, tokenizer) of a Hugging Face folder holding a decoder LM or a T5."""
    model = hub.load(folder)
    generating = [k for k, f in hub.FAMILIES.items() if f.model in ("lm", "encdec")]
    if model.family not in generating:
        raise hub.UnsupportedModelError(
            f"{folder} holds a {model.family} model; generation needs a decoder LM or an "
            f"encoder-decoder ({', '.join(generating)})"
        )
    tokenizer = folder_tokens.required(folder, model.family, "SOURCE")
    return model.params, model.config, data.BPETokenizer(tokenizer)


def decoder_start(path: str | Path) -> int | None:
    """An encoder-decoder folder's decoder start token (config.json's
    decoder_start_token_id, T5's 0 when absent); None for a decoder LM."""
    path = Path(path)
    if not (path / "config.json").exists() or (path / "run.json").exists():
        return None
    family, hf = hub.read_config(path)
    if hub.FAMILIES[family].model != "encdec":
        return None
    where = f"{path}/config.json: decoder_start_token_id"
    return folder_tokens.token_ids(hf.get("decoder_start_token_id") or 0, where)[0]


def read_prompts(path: Path) -> list[str]:
    """The non-empty lines of a --prompts file, split at "\n" alone (a "\r" before it
    left out): never at what str.splitlines also breaks at (a form feed, U+2028, NEL),
    which a prompt holds as text; ParameterError naming the flag, for a file that cannot
    be read or is not UTF-8 text."""
    from models.training.datasets import text_file

    try:
        text = text_file(path)
        lines = [line.removesuffix("\r") for line in text.split("\n") if line.strip()]
    except OSError as e:
        raise ParameterError(f"--prompts {path}: cannot read it ({e.strerror})") from None
    except data.DataError as e:
        raise ParameterError(f"--prompts {e}") from None
    if not lines:
        raise ParameterError(f"--prompts {path}: the file holds no prompt (one per line)")
    return lines


# Every numeric flag's allowed values, checked before the model is read (models/cli/train.py's
# Range); temperature and top-p are models.inference.sampling.Sampling's to check.
RANGES = {
    "max_new": Range(0, COUNT),
    "max_length": Range(1, COUNT),
    "beams": Range(1, 1 << 16),
    "seed": Range(0, 2**32 - 1),
    "top_k": Range(0, COUNT),
    "step": Range(0, COUNT),
    **CLUSTER_RANGES,
}


OLD = ("--checkpoint",)  # SOURCE's earlier spelling, still read (models/io/source.py)


def arguments(argv=None, prog: str = "python -m models.cli.generate"):
    p = Parser(
        prog=prog,
        description=__doc__.split("\n")[0],
        formatter_class=Defaults,  # every flag shows its default
    )
    add_source(p, "a training run's --out folder, or a Hugging Face folder (a decoder LM or "
               "T5)", OLD)  # fmt: skip
    p.add_argument("--prompt", default="The assert statement", help="the text to continue")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="a text file of prompts, one per line, decoded as one batch (replaces --prompt)",
    )
    p.add_argument("--mode", default="greedy", choices=MODES, help="how tokens are chosen")
    p.add_argument("--max-new", type=int, default=200, help="new tokens per prompt, at most")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens a row holds at most, prompt included: the KV cache's slots (None: the "
        "model's training length, and a single --prompt goes on past it in a sliding window)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.8, help="sample: divide the logits by it (> 0)"
    )
    p.add_argument(
        "--top-k", type=int, default=0, help="sample: only the k likeliest tokens (0: all)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample: only the nucleus, the likeliest tokens of total probability >= p (1: all)",
    )
    p.add_argument(
        "--eos",
        default=None,
        help="a token id or a token's text that ends a row: the row emits it from then on "
        "and its text stops before it (None: the folder's generation_config.json / "
        "config.json EOS ids, any of which ends a row; none: no end token)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="render each prompt as a user turn of the folder's chat template (instruct models)",
    )
    p.add_argument(
        "--mesh", type=parse_mesh, default=None, help="mesh axes and sizes, e.g. data=2,model=4"
    )
    p.add_argument("--layout", default="", help='rules like "heads:model;d_ff:model" (with --mesh)')
    p.add_argument("--beams", type=int, default=4, help="beam: the beam's width")
    p.add_argument("--seed", type=int, default=0, help="sample: the random seed")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end a row at the first occurrence of TEXT, cut from its text (repeatable: any)",
    )
    p.add_argument(
        "--stream", action="store_true", help="print the text as it is decoded (one prompt)"
    )
    p.add_argument(
        "--jsonl",
        action="store_true",
        help="print one JSON object per prompt: prompt, text, tokens, finish_reason "
        "(stop, eos or length)",
    )
    cluster.add_flags(p)
    return resolve(p, p.parse_args(argv), OLD)


def eos_of(text: str | None, tokenizer, folder: Path | None) -> list[int]:
    """The end ids of --eos: an int, a token's text, none, or (None) the folder's."""
    if text is None:
        return folder_tokens.eos_ids(folder) if folder is not None else []
    if text == "none":
        return []
    if text.isascii() and text.lstrip("-").isdigit():
        return [int(text)]
    found = tokenizer.tok.token_to_id(text) if isinstance(tokenizer, data.BPETokenizer) else None
    if found is None:
        raise ParameterError(f"--eos {text!r} is neither a token id nor a token of the tokenizer")
    return [found]


def encode_prompts(texts, tokenizer, folder: Path | None, chat: bool) -> list[list[int]]:
    """Token ids of each prompt; with `chat`, of the folder's chat template rendered
    around it (its special tokens are the template's: none added by the tokenizer)."""
    if not chat:
        return [[int(i) for i in tokenizer.encode(t)] for t in texts]
    if folder is None or not isinstance(tokenizer, data.BPETokenizer):
        raise ParameterError("--chat needs a Hugging Face folder (or a fine-tune of one)")
    rendered = [folder_tokens.apply_chat(folder, t) for t in texts]
    return [tokenizer.tok.encode(t, add_special_tokens=False).ids for t in rendered]


def end_ids(eos: str | None, tokenizer, folder: Path | None, vocab: int) -> list[int]:
    """The ids that end a row: --eos's (`eos_of`; ParameterError for one outside the
    vocabulary, which would never end a row), or by default the folder's within it (a
    folder's id past the vocabulary is never decoded: GPT-2's 50256 on a smaller one)."""
    ends = eos_of(eos, tokenizer, folder)
    if eos is None:
        return [e for e in ends if 0 <= e < vocab]
    if outside := [e for e in ends if not 0 <= e < vocab]:
        raise ParameterError(
            f"--eos {eos}: id {outside[0]} is not in the model's vocabulary (0 to {vocab - 1})"
        )
    return ends


@one_line_on_ctrl_c
def main(argv=None, prog: str = "python -m models.cli.generate") -> int:
    args = arguments(argv, prog)
    name = prog.removeprefix("python -m ")
    try:  # several processes: each decodes alike on its own devices, process 0 prints
        several = cluster.join(args, math.prod(args.mesh.values()) if args.mesh else None, True)
    except cluster.ClusterError as e:
        return fail(e, 2, name)
    if several:
        cluster.say(cluster.describe())
    try:
        if complaint := check_ranges(args, RANGES):
            raise ParameterError(complaint)
        # checked before loading
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        stops = check_stops(args.stop, "--stop")
        texts = read_prompts(args.prompts) if args.prompts else [args.prompt]
        check_output(args, len(texts))
        if args.layout and not args.mesh:
            raise ParameterError("--layout places the model on a --mesh; pass --mesh too")
        if args.layout.strip() == "auto":  # train's and eval's search costs a training step
            raise ParameterError(
                "--layout auto searches a training step's layout (train, eval); generate "
                'takes rules, e.g. --layout "heads:model;d_ff:model"'
            )
        params, cfg, tokenizer = load(args.source, args.step)
        folder = base_folder(args.source)  # its template and ids, read before compiling
        prompts = encode_prompts(texts, tokenizer, folder, args.chat)
        ends = end_ids(args.eos, tokenizer, folder, cfg.vocab)
        start = decoder_start(args.source)
        mesh = Mesh(args.mesh, devices=jax.local_devices()) if args.mesh else None
        if mesh is not None:  # on the host, for the lowered programs to lay out
            params = jax.device_get(params)
        dec = Decoder(params, cfg, slots=args.max_length, mesh=mesh, layout=args.layout)
        # the prompt itself is printed before a decoder LM's continuation (not a T5's
        # output or a chat reply)
        shown = ["" if start is not None or args.chat else t for t in texts]
        stream, end_stream = streamer(shown[0]) if args.stream else (None, None)
        cont = Continuations(tokenizer, len(prompts), ends, stops, on_text=stream)
        continue_prompts(dec, prompts, cont, Request.of_flags(args, sampling), start)
    except (*user_errors(), KeyError) as e:
        return cluster.ended(fail(e, 2, name), several)
    if args.stream:
        end_stream()
    elif args.jsonl:
        for i, text in enumerate(texts):
            cluster.say(json.dumps(record(text, cont, i), ensure_ascii=False))
    else:  # a blank line between continuations: one that holds a newline stays apart
        cluster.say("\n\n".join(s + t for s, t in zip(shown, cont.texts, strict=True)))
    return 0


def check_output(args, prompts: int) -> None:
    """ParameterError for output flags that do not go together: --stream prints one
    row's tokens (one prompt, not beam, not --jsonl)."""
    if args.mode == "beam" and prompts > 1:
        raise ParameterError("--mode beam decodes one prompt; --prompts gave several")
    if args.stream and args.jsonl:
        raise ParameterError("--stream prints text as it decodes; --jsonl prints objects: one")
    if args.stream and (prompts > 1 or args.mode == "beam"):
        what = "--mode beam" if args.mode == "beam" else f"--prompts gave {prompts}"
        raise ParameterError(
            f"--stream prints one prompt's tokens as they are chosen; {what} (use --jsonl)"
        )


def streamer(prompt: str):
    """(on_text, end) of --stream: on_text(row, piece) prints a piece of the text, the
    prompt before the first (so that a prompt decoding refuses prints nothing); end()
    prints the newline (and the prompt, if no piece came)."""
    pending = [prompt]

    def on_text(row: int, piece: str) -> None:
        show((pending.pop() if pending else "") + piece)

    return on_text, lambda: on_text(0, "\n")


def show(text: str) -> None:
    """Print `text` as it is, at once, on process 0 (a streamed piece)."""
    if jax.process_index() == 0:
        print(text, end="", flush=True)


def record(prompt: str, cont: Continuations, i: int) -> dict:
    """The --jsonl object of prompt i: its text, new tokens and finish reason."""
    return {
        "prompt": prompt,
        "text": cont.texts[i],
        "tokens": cont.tokens[i],
        "finish_reason": cont.reasons[i],
    }


@dataclasses.dataclass(frozen=True)
class Request:
    """How to continue a batch of prompts (generate's flags): at most `max_new` new
    tokens each; the likeliest (greedy), drawn as `sampling` says, or by a beam search of
    width `beams` (one prompt); a row also ends when it holds `max_length` tokens (None:
    a single prompt slides past the cache, `Decoder.generate`)."""

    max_new: int
    sampling: Sampling | None = None
    beams: int | None = None
    max_length: int | None = None

    @classmethod
    def of_flags(cls, args, sampling: Sampling) -> Request:
        """The request of --mode, --max-new, --max-length, --beams and `sampling` (of
        --temperature, --top-k, --top-p, --seed), read only with --mode sample."""
        return cls(
            args.max_new, sampling if args.mode == "sample" else None,
            args.beams if args.mode == "beam" else None, args.max_length,
        )  # fmt: skip


def continue_prompts(
    dec: Decoder, prompts: list[list[int]], cont: Continuations, request: Request, start=None
) -> Continuations:
    """Decode `prompts` (token lists) into `cont` (their ends, stop strings, streaming),
    finished, as `request` says; an encoder-decoder's prompts are its inputs, decoded
    from `start`. A single prompt without `max_length` (and beam) takes
    `Decoder.generate`'s sliding window past the cache; otherwise the batch decodes in
    `Decoder.decode`."""
    ends = sorted(cont.ends)
    if start is not None:  # an encoder-decoder: the prompts are its inputs
        dec.encode(prompts)
        prompts = [[start]] * len(prompts)
    r = request
    if r.beams is not None:  # the best beam, then its ends and stop strings
        out = dec.generate(prompts[0], r.max_new, beams=r.beams, eos=ends)
        for t in out:
            if cont.push([t])[0]:
                break
    elif len(prompts) == 1 and r.max_length is None:
        dec.generate(prompts[0], r.max_new, sampling=r.sampling, eos=ends, on_step=cont.push)
    else:
        dec.decode(
            prompts, r.max_new, sampling=r.sampling, eos=ends, max_length=r.max_length,
            on_step=cont.push,
        )  # fmt: skip
    return cont.finish()


if __name__ == "__main__":
    sys.exit(main())
