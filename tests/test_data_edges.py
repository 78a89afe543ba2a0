"""What users feed the data path (models/training/datasets.py, chat.py, data.py), checked
against oracles computed apart: JSON lines split at newlines alone as the JSON lines
format says (json.loads of each), a UTF-8 byte order mark that is no text (Python's
utf-8-sig codec), suffixes in any case, gzip files (gzip.decompress), turn ends of a
template whose eos_token is not the end of a turn (transformers' apply_chat_template
assistant mask), and validation windows counted by hand."""

import gzip
import json

import numpy as np
import pytest

from models.training import chat, corpora, data, datasets

CONV = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a\u2028b\x85c\x0cd"}]


def _lines(path, rows, ending="\n"):
    path.write_text(ending.join(json.dumps(r, ensure_ascii=False) for r in rows), "utf-8")
    return path


def test_json_lines_split_at_newlines_alone(tmp_path):
    """U+2028, NEL and form feed are text inside a JSON string (json.dumps writes them
    raw with ensure_ascii=False), not line breaks as str.splitlines takes them."""
    docs = ["one\u2028two", "three\x85four\x0cfive", "six"]
    got = datasets.read(_lines(tmp_path / "t.jsonl", [{"text": d} for d in docs], "\r\n"))
    assert got == "\n".join(docs)
    chats = corpora.load(str(_lines(tmp_path / "c.jsonl", [{"messages": CONV}] * 2)))
    assert [m for _, m in chats.items] == [CONV, CONV]
    bad = _lines(tmp_path / "bad.jsonl", [{"text": docs[0]}, {"text": docs[1]}])
    bad.write_text(bad.read_text("utf-8") + "\n{oops\n", "utf-8")
    with pytest.raises(data.DataError, match=r"bad.jsonl:3: not a JSON line"):
        datasets.read(bad)
