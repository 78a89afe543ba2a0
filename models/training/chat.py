"""Chat (SFT) data: JSON lines of `{"messages": [{"role", "content"}, ...]}`, rendered
with a chat template, the loss on the assistant's tokens alone, examples packed into
rows without attending across them (docs/chat.md).

- Rendering: the tokenizer folder's chat template (chat_template.jinja or
  tokenizer_config.json's `chat_template`) as transformers' `apply_chat_template`
  renders it (jinja2's sandbox, bounded: models/io/sandbox.py; `messages`, the line's
  `tools`, `bos_token`, `eos_token`, `add_generation_prompt`, and transformers'
  globals and filters), then tokenized whole
  without the tokenizer's own special tokens (the template writes them). Without a
  template (the byte tokenizer, a fresh BPE), DEFAULT_TEMPLATE, ChatML's layout.
- Masking, incrementally as TRL and torchtune do: the text up to each assistant
  message with the generation prompt, then up to the end of that message (to its
  last end-of-turn text: the folder's eos token or the text of one of its eos ids,
  `<|im_end|>` of the default template, where the message's text holds one); the
  tokens between the two (the message's content and its end-of-turn token) have
  weight 1, every other token 0
  (transformers' `{% generation %}` mask around content and end token). A token that
  straddles a boundary is the assistant's.
- Packing: examples go into rows of --length positions in file order, a new row when
  the next does not fit; each row carries `segments` (1, 2, ... per example, 0 for the
  padding after them) and `positions` (each example's from 0). models/transformer.py
  hides other segments' keys (layers.segment_bias) and embeds or rotates by
  `positions`, so a packed row's loss is the sum of its examples' run alone.
- An example longer than --length + 1 tokens is cut to its first --length + 1 tokens,
  said in one line naming its lines (an example left without assistant tokens is
  dropped); a line that is not an example is a DataError naming file and line.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from models.training.data import VALIDATION_FRACTION, DataError
from models.training.datasets import encodable

FIELD = "messages"
# the roles transformers' templates render: tool results are `tool` (Qwen, Mistral,
# Llama 3.1's too), `function` (older OpenAI-style data) or `ipython` (Llama 3.1's own)
ROLES = ("system", "user", "assistant", "tool", "function", "ipython")
TOOLS = "tools"  # a line's tool definitions, passed to the template as `tools`
# ChatML's layout (Qwen's, SmolLM's): the template of a run whose tokenizer has none;
# tool use as Qwen2.5 writes it: the tools in a system turn first, each call a
# <tool_call> of its JSON after the content
DEFAULT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}"
    "{{ t | tojson + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% for call in m['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n' + call | tojson + '\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FIELDS = ("inputs", "targets", "weights", "segments", "positions")


class Example(NamedTuple):
    """One conversation: where it is ("FILE:LINE"), its messages (each as the line
    holds it: role, content, and what else a template may read, tool_calls, name,
    tool_call_id), and the line's tool definitions (None without)."""

    where: str
    messages: list[dict]
    tools: list | None = None


class Conversations:
    """The examples of a chat file (`Example`s), checked."""

    def __init__(self, items: list[Example], path: Path):
        self.items, self.path = items, path

    def __len__(self) -> int:
        return len(self.items)

    def split(self, fraction: float) -> tuple[Conversations, Conversations]:
        """(first part, the last `fraction` of the examples: at least one)."""
        cut = len(self.items) - max(1, round(len(self.items) * fraction))
        head, tail = self.items[:cut], self.items[cut:]
        return Conversations(head, self.path), Conversations(tail, self.path)

    def text(self) -> str:
        """Every message's content, one per line (what `--tokenizer bpe` trains on)."""
        return "\n".join(m.get("content") or "" for e in self.items for m in e.messages)


def is_chat(path: Path, text_field: str) -> bool:
    """Whether `path` is a JSON lines file (gzip's too) whose first object has a
    `messages` field and no `text_field` (a text file's documents)."""
    from models.training.datasets import suffix

    if suffix(path) != ".jsonl" or not path.is_file():
        return False
    gz = path.name.lower().endswith(".gz")
    with (gzip.open if gz else open)(path, "rt", encoding="utf-8-sig", errors="replace") as f:
        try:
            first = next((line for line in f if line.strip()), "")
        except (OSError, EOFError, zlib.error):  # a damaged gzip file: `read` says so
            return False
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and FIELD in row and text_field not in row


def read(path: str | Path, flag: str = "--data") -> Conversations:
    """The conversations of a JSON lines file; DataError naming `flag`, the file and the
    line of the first that is not one (see `check`)."""
    from models.training.datasets import json_lines, suffix, text_file

    path = Path(path)
    if path.is_dir() or suffix(path) != ".jsonl":
        raise DataError(f"{flag} {path}: chat data is one JSON lines file (.jsonl)")
    if not path.exists():
        raise DataError(f"{flag} {path}: no such file")
    try:
        lines = json_lines(text_file(path))
    except DataError as e:
        raise DataError(f"{flag} {e}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            where = f"{path}:{n}"
            items.append(Example(where, *check(line, f"{flag} {where}")))
    if not items:
        raise DataError(f"{flag} {path}: no conversations found")
    return Conversations(items, path)


def check(line: str, where: str) -> tuple[list[dict], list | None]:
    """(messages, tools) of one JSON line; DataError naming `where` when it is not JSON,
    not an object with a non-empty `messages` list of {"role", "content"} objects (a
    role of ROLES, content text; an assistant's calling tools, `tool_calls`, may have
    none), has `tools` that are not a list, or has no assistant message (nothing to
    learn). A message's other fields are kept for the template, as transformers passes
    them."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not a JSON line ({e.msg})") from None
    if not isinstance(row, dict) or FIELD not in row:
        has = f"has {', '.join(map(str, row))}" if isinstance(row, dict) else "not an object"
        raise DataError(f"{where}: no {FIELD!r} field ({has})")
    messages = row[FIELD]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {FIELD!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and not calls):
            raise DataError(f"{where}: message {i} must be an object with role and content")
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}: message {i} has role {m['role']!r}, not one of {', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise DataError(f"{where}: message {i}'s content must be text")
        if isinstance(m.get("content"), str):
            encodable(m["content"], f"{where}: message {i}'s content")
        rest = {k: v for k, v in m.items() if k not in ("role", "content")}
        encodable(json.dumps(rest, ensure_ascii=False), f"{where}: message {i}'s {', '.join(rest)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (the loss covers the assistant's tokens)")
    tools = row.get(TOOLS)
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: {TOOLS!r} must be a list of tool definitions")
    if tools is not None:
        encodable(json.dumps(tools, ensure_ascii=False), f"{where}: its {TOOLS}")
    return [dict(m) for m in messages], tools


class Template(NamedTuple):
    """A chat template, where it is read from (for messages), the special tokens' text
    it renders with, and the texts that end an assistant's turn (the eos token's and
    those of the folder's eos ids: what the template writes after one, a newline before
    the next turn, is not learnt), and the date its `strftime_now` renders: an ISO date
    (a training run's, recorded so that a resume renders the same tokens), "none" (no
    clock, as before the sandbox had one) or None (today, as transformers renders)."""

    source: str
    where: str
    bos: str = ""
    eos: str = ""
    ends: tuple[str, ...] = ()
    date: str | None = None


def template(folder) -> Template:
    """The chat template of a tokenizer folder (a Hugging Face folder, a fine-tune's
    base), else DEFAULT_TEMPLATE."""
    from models.io import folder_tokens

    if folder is not None and (text := folder_tokens.chat_template(folder)) is not None:
        bos, eos = (folder_tokens.special_token(folder, f"{k}_token") or "" for k in ("bos", "eos"))
        ends = tuple(dict.fromkeys(e for e in (eos, *_eos_texts(folder)) if e))
        return Template(text, f"{folder}'s chat template", bos, eos, ends)
    return Template(
        DEFAULT_TEMPLATE, "the default chat template (docs/chat.md)", ends=("<|im_end|>",)
    )


def _eos_texts(folder) -> list[str]:
    """The texts of the folder's eos ids (generation_config.json's, config.json's): a
    chat model's end of turn where it is not the eos_token (Gemma's <end_of_turn>,
    Phi-3's <|end|>, Llama 3's <|eot_id|> beside <|end_of_text|>)."""
    from models.io import folder_tokens

    ids = folder_tokens.eos_ids(folder)
    tok = folder_tokens.read(folder) if ids else None
    if tok is None:
        return []
    # added tokens alone: an ordinary token's text ("." of a toy config) inside an
    # answer would end its turn early
    added = tok.get_added_tokens_decoder()
    return [added[i].content for i in ids if i in added]


def render(t: Template, messages: list[dict], generation: bool, where: str, tools=None) -> str:
    """The conversation as the template renders it (with the line's `tools`, as
    transformers passes them); DataError naming `where` and the template when it fails
    (raise_exception, an error, its bounds)."""
    from models.io import sandbox

    try:
        return sandbox.render(
            t.source, messages=messages, add_generation_prompt=generation,
            bos_token=t.bos, eos_token=t.eos, tools=tools, **sandbox.clock(t.date),
        )  # fmt: skip
    except sandbox.TemplateFailure as e:
        raise DataError(f"{where}: {t.where} fails on it: {e}") from None


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def encode(messages: list[dict], t: Template, tokenizer, where: str, tools=None):
    """(ids, weights): the rendered conversation's token ids and 1.0 on the assistant's
    tokens (module docstring: its tool calls too), 0.0 elsewhere (tool results too)."""
    tokens = lambda text: np.asarray(tokenizer.encode(text, specials=False), np.int64)
    full = render(t, messages, False, where, tools)
    ids = tokens(full)
    weights = np.zeros(len(ids), np.float32)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(t, messages[:i], True, where, tools)
        upto = render(t, messages[: i + 1], False, where, tools)
        if not (full.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{where}: {t.where} renders message {i} otherwise in the whole conversation "
                "than after the messages before it, so its tokens cannot be told apart"
            )
        start = _common(tokens(before), ids)
        # up to the end of the turn: its last end text written after the generation prompt
        cut = max((k + len(e) for e in t.ends if (k := upto.rfind(e)) >= len(before)), default=0)
        upto = upto[:cut] if cut else upto
        last = tokens(upto)
        end = _common(last, ids)
        weights[start : end + (end < len(last))] = 1.0  # a straddling token: the assistant's
    return ids, weights


def pack(examples: list[tuple[np.ndarray, np.ndarray]], length: int) -> dict[str, np.ndarray]:
    """Rows of FIELDS (rows, length) of next-token examples (ids, weights), each at most
    length + 1 tokens, in order, a new row when the next does not fit."""
    rows, at = [], length
    for ids, w in examples:
        n = len(ids) - 1
        if at + n > length:
            rows.append({k: np.zeros(length, np.float32 if k == "weights" else np.int32)
                         for k in FIELDS})  # fmt: skip
            at = 0
        row = rows[-1]
        span = slice(at, at + n)
        row["inputs"][span], row["targets"][span], row["weights"][span] = ids[:-1], ids[1:], w[1:]
        row["segments"][span] = row["segments"].max() + 1
        row["positions"][span] = np.arange(n)
        at += n
    return {k: np.stack([r[k] for r in rows]) for k in FIELDS}


class ChatCorpus:
    """Packed rows of the train and validation conversations, with the interface of
    models.training.data.Corpus (`batch`, `validation_batches`, `validation_windows`,
    `bytes_per_token`)."""

    def __init__(self, chats, tokenizer, length: int, objective: str, valid, t: Template):
        if objective != "lm":
            raise DataError(
                f"chat data trains decoder LMs (next-token prediction), not the {objective!r} "
                "objective: pass --model lm or moe, or --init-from a decoder LM"
            )
        # the held-out split as a message names it (`eval` passes its data as both)
        held = f"--{'' if valid is chats else 'val-'}data {getattr(valid, 'path', '')}"
        if valid is None:
            held = f"the validation split of --data {chats.path} (its last tenth)"
            if len(chats) < 2:
                raise DataError(
                    f"--data {chats.path}: one conversation; the validation split (its last "
                    "tenth) needs two or more, or pass --val-data"
                )
            chats, valid = chats.split(VALIDATION_FRACTION)
        for flag, part in (("--data", chats), ("--val-data", valid)):
            if not isinstance(part, Conversations):
                raise DataError(f"{flag}: chat data goes with chat data (both JSON lines of "
                                f"{FIELD!r}), not text or token ids")  # fmt: skip
        self.tokenizer, self.length, self.objective = tokenizer, length, objective
        self.window = length + 1
        held_out = self._examples(valid, t, held)
        self.valid = pack(held_out, length)
        # `eval` scores its data as both splits: encoded once
        train = self._examples(chats, t, f"--data {chats.path}") if chats is not valid else None
        self.train = self.valid if train is None else pack(train, length)
        targets = [ids[1:][w[1:] > 0] for ids, w in held_out]
        self.valid_bytes = sum(tokenizer.byte_count(x) for x in targets)
        self.valid_tokens = sum(len(x) for x in targets)

    def _examples(self, chats: Conversations, t: Template, what: str):
        """(ids, weights) of each conversation, cut to the row's length + 1; one line
        names those cut and those dropped for keeping no assistant token; DataError
        naming `what` (the split) when none keeps one."""
        from models.cli import cluster

        out, cut, dropped = [], [], []
        for where, messages, tools in chats.items:
            ids, w = encode(messages, t, self.tokenizer, where, tools)
            if len(ids) > self.window:
                ids, w = ids[: self.window], w[: self.window]
                cut.append(where.rsplit(":", 1)[1])
            if not w[1:].any():
                dropped.append(where.rsplit(":", 1)[1])
                continue
            out.append((ids, w))
        lines = lambda ns: f"lines {', '.join(ns[:10])}{' ...' * (len(ns) > 10)}"  # noqa: E731
        if cut:
            gone = f"; {len(dropped)} kept no assistant token and are left out" if dropped else ""
            cluster.say(
                f"{chats.path}: {len(cut)} conversation(s) longer than --length {self.length} "
                f"+ 1 tokens cut to it ({lines(cut)}){gone}"
            )
        elif dropped:  # uncut: their template rendered no assistant token (empty answers)
            cluster.say(
                f"{chats.path}: {len(dropped)} conversation(s) whose assistant messages "
                f"render no token ({t.where}) left out ({lines(dropped)})"
            )
        if not out:
            why = f"within --length {self.length} + 1 tokens: pass a longer --length"
            raise DataError(
                f"{what}: no conversation keeps an assistant token "
                f"{why if cut else f'as {t.where} renders them'}"
            )
        return out

    def batch(self, step: int, batch: int, seed: int, rows=None) -> dict[str, np.ndarray]:
        """The rows of `step`: each epoch visits every packed row once, in an order
        drawn from (seed, epoch). With `rows` (this process's), only those are filled."""
        n = len(self.train["inputs"])
        index = step * batch + np.arange(batch)
        orders = {e: np.random.default_rng([seed, e]).permutation(n) for e in set(index // n)}
        picked = np.array([orders[i // n][i % n] for i in index])
        rows = np.arange(batch) if rows is None else np.asarray(rows, dtype=np.int64)
        out = {k: np.zeros((batch, self.length), v.dtype) for k, v in self.train.items()}
        for k, v in self.train.items():
            out[k][rows] = v[picked[rows]]
        return out

    def validation_windows(self) -> int:
        """The packed validation rows."""
        return len(self.valid["inputs"])

    def validation_batches(self, batch: int, max_batches: int | None = None):
        """The validation rows in order (the last batch padded with zero-weight rows)."""
        n = self.validation_windows()
        if max_batches is not None:
            n = min(n, max_batches * batch)
        for i in range(0, n, batch):
            chunk = np.resize(np.arange(i, min(i + batch, n)), batch)
            out = {k: v[chunk] for k, v in self.valid.items()}
            out["weights"][min(batch, n - i) :] = 0.0
            yield out

    def bytes_per_token(self, windows: int | None = None) -> float:
        """UTF-8 bytes per weighted (assistant) validation token: of every row, or with
        `windows` fewer than all (eval's --max-batches) of the first `windows` rows."""
        if windows is None or windows >= self.validation_windows():
            return self.valid_bytes / max(self.valid_tokens, 1)
        rows = {k: v[:windows] for k, v in self.valid.items()}
        scored = rows["targets"][rows["weights"] > 0]
        return self.tokenizer.byte_count(scored) / max(len(scored), 1)
