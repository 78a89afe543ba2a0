"""What `--data` trains and evaluates on, by its kind: text or token ids
(models/training/data.py's Corpus, windows cut from one stream), or conversations
(models/training/chat.py's ChatCorpus, packed examples with the loss on the assistant's tokens).
`--data-format` says which (auto: chat for JSON lines whose first object has a
`messages` field and no `--text-field` field)."""

from __future__ import annotations

from pathlib import Path

from models.training import chat, data

FORMATS = ("auto", "text", "chat")  # --data-format


def load(path: str | None = None, flag: str = "--data", text_field: str = "text", fmt="auto"):
    """What `path` holds: `data.load_text`'s text or token ids, or conversations
    (`chat.Conversations`) when `fmt` is "chat", or "auto" and the file is chat data;
    DataError naming `flag` and the file at fault."""
    if fmt == "chat" and path is None:
        raise data.DataError(f"--data-format chat: pass the conversations as {flag} FILE.jsonl")
    if path is not None and (
        fmt == "chat" or (fmt == "auto" and chat.is_chat(Path(path), text_field))
    ):
        return chat.read(path, flag)
    return data.load_text(path, flag, text_field)


def make(text, tokenizer, length: int, objective: str = "lm", valid=None, folder=None,
         date: str | None = None):  # fmt: skip
    """A data.Corpus of `text` (and `valid`), or of conversations a chat.ChatCorpus,
    rendered with `folder`'s chat template (a tokenizer's folder; None or one without
    a template: chat.DEFAULT_TEMPLATE) on `date` (chat.Template.date)."""
    if any(isinstance(t, chat.Conversations) for t in (text, valid)):
        t = chat.template(folder)._replace(date=date)
        return chat.ChatCorpus(text, tokenizer, length, objective, valid, t)
    return data.Corpus(text, tokenizer, length, objective, valid)
