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
    assert [e.messages for e in chats.items] == [CONV, CONV]
    bad = _lines(tmp_path / "bad.jsonl", [{"text": docs[0]}, {"text": docs[1]}])
    bad.write_text(bad.read_text("utf-8") + "\n{oops\n", "utf-8")
    with pytest.raises(data.DataError, match=r"bad.jsonl:3: not a JSON line"):
        datasets.read(bad)


def test_a_byte_order_mark_is_no_text(tmp_path):
    """Notepad's UTF-8 files begin with a BOM: read as Python's utf-8-sig reads them, it
    is neither a token of the text nor a JSON line that fails."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + "héllo\r\n".encode())
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_bytes(bom + b"hello\n")
    (tmp_path / "dir" / "b.txt").write_bytes(bom + b"world")
    (tmp_path / "t.jsonl").write_bytes(bom + b'{"text": "x"}\r\n{"text": "y"}')
    (tmp_path / "c.jsonl").write_bytes(bom + (json.dumps({"messages": CONV}) + "\n").encode() * 2)
    for name in ("a.txt", "t.jsonl"):
        raw = (tmp_path / name).read_bytes().decode("utf-8-sig")
        want = raw if name == "a.txt" else "\n".join(json.loads(x)["text"] for x in raw.split("\n"))
        assert corpora.load(str(tmp_path / name)) == want
    assert [e.messages for e in corpora.load(str(tmp_path / "c.jsonl")).items] == [CONV, CONV]
    assert datasets.read(tmp_path / "dir") == "hello\nworld"  # each of a folder's files


def test_suffixes_in_any_case_and_gzip_files_are_read_by_kind(tmp_path):
    """`.JSONL` holds JSON lines and `.npy.NPY` ids (never their raw text); a gzip file
    is its decompressed content (gzip.decompress's); token files are not decompressed."""
    rows = [{"text": "first"}, {"text": "second"}]
    _lines(tmp_path / "UP.JSONL", rows)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress((tmp_path / "UP.JSONL").read_bytes()))
    (tmp_path / "plain.TXT.gz").write_bytes(gzip.compress("ünï\n".encode()))
    for name in ("UP.JSONL", "t.jsonl.gz"):
        assert datasets.read(tmp_path / name) == "first\nsecond"
    assert datasets.read(tmp_path / "plain.TXT.gz") == "ünï\n"
    with open(tmp_path / "ids.NPY", "wb") as f:  # np.save would add .npy to the name
        np.save(f, np.arange(7, dtype=np.int32))
    np.testing.assert_array_equal(datasets.read(tmp_path / "ids.NPY").ids, np.arange(7))
    chats = _lines(tmp_path / "c.JSONL", [{"messages": CONV}] * 2)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(chats.read_bytes()))
    for name in ("c.JSONL", "c.jsonl.gz"):
        assert [e.messages for e in corpora.load(str(tmp_path / name)).items] == [CONV, CONV]
    (tmp_path / "ids.npy.gz").write_bytes(gzip.compress((tmp_path / "ids.NPY").read_bytes()))
    (tmp_path / "torn.txt.gz").write_bytes(gzip.compress(b"abc" * 100)[:20])
    for name, says in [("ids.npy.gz", "a compressed .npy file; decompress"),
                       ("torn.txt.gz", "not a readable gzip file")]:  # fmt: skip
        with pytest.raises(data.DataError, match=f"^--data {tmp_path / name}: {says}"):
            corpora.load(str(tmp_path / name))


# Gemma's layout: turns end with <end_of_turn>, an eos id of generation_config.json that
# is not tokenizer_config.json's eos_token (<eos>); the newline after it is no answer.
GEMMA = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<end_of_turn>' }}"
    "{% endgeneration %}{% else %}{{ m['content'] + '<end_of_turn>' }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GEMMA_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained on a few lines (tokenizers), as JSON: each test's copy."""
    lines = ["What does assert do?", "It raises AssertionError.", "Name a loop: for, while."]
    return data.BPETokenizer.train("\n".join(lines * 20), 300).tok.to_str()


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory, bpe):
    """A tokenizer folder: the BPE, Gemma's template and specials."""
    from tokenizers import Tokenizer

    out = tmp_path_factory.mktemp("gemma")
    tok = Tokenizer.from_str(bpe)
    tok.add_special_tokens(GEMMA_SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": GEMMA, "bos_token": "<bos>", "eos_token": "<eos>",
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    # and the newline's id, as a toy config might name: no added token, no turn's end
    ends = [tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>"), tok.encode("\n").ids[0]]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return out


def test_a_turn_ends_at_an_eos_id_of_generation_config(gemma_folder):
    """The weights are transformers' assistant mask (its {% generation %} tags): the
    answer and <end_of_turn>, not the newline after it."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(gemma_folder)
    ours = data.BPETokenizer(data.load_tokenizer_file(gemma_folder / "tokenizer.json").tok)
    chats = [
        CONV[:1] + [{"role": "assistant", "content": "It raises AssertionError."}],
        [{"role": "user", "content": "Name a loop."}, {"role": "assistant", "content": "for"},
         {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "while"}],
    ]  # fmt: skip
    for messages in chats:
        ids, weights = chat.encode(messages, chat.template(gemma_folder), ours, "x.jsonl:1")
        want = theirs.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        np.testing.assert_array_equal(ids, want["input_ids"])
        np.testing.assert_array_equal(weights, want["assistant_masks"])


@pytest.mark.parametrize("n", [5, 9, 11, 12, 13])
def test_validation_windows_cover_every_token(n):
    """The validation targets are the split's tokens after the first, each once, --length
    at a time: the last window ends past the data where the split's length asks it (its
    missing targets weigh 0). 9 tokens at --length 4 are two windows (the last, ending
    at the last token, was left out once) and 5 tokens one (refused once)."""
    text, length = "abcdefghijklm"[:n], 4
    corpus = data.Corpus("x" * 100, data.ByteTokenizer(), length, valid=text)
    batches = list(corpus.validation_batches(3))
    got = np.concatenate([b["targets"][b["weights"] > 0].ravel() for b in batches])
    assert bytes(got.astype(np.uint8)).decode() == text[1:]
    assert corpus.validation_windows() == -(-(n - 1) // length)
    with pytest.raises(data.DataError, match="train split has 4 tokens; a training window "
                       "takes 5"):  # fmt: skip
        data.Corpus("x" * 4, data.ByteTokenizer(), length, valid=text)


def test_linked_folders_are_read_and_a_link_loop_ends(tmp_path):
    """A corpus of linked sub-folders (ln -s /big/wiki data/wiki) is read whole, in path
    order, and fingerprinted with them (a change there is seen on --resume); a link
    back up is not followed twice."""
    from models.io import files

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.txt").write_text("inner\n")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "a.txt").write_text("outer\n")
    (data_dir / "linked").symlink_to(tmp_path / "other", target_is_directory=True)
    (data_dir / "loop").symlink_to(data_dir, target_is_directory=True)
    assert datasets.read(data_dir) == "outer\ninner\n"
    before = files.fingerprint(data_dir)
    (tmp_path / "other" / "b.txt").write_text("INNER\n")
    assert files.fingerprint(data_dir)["sha256"] != before["sha256"]


def test_named_templates_without_a_default_are_refused_naming_them(tmp_path):
    """transformers refuses a list of named templates with no "default" (it cannot tell
    which); reading none of them trained with ChatML's layout instead, silently."""
    from models.families.common import DamagedFileError
    from models.io import folder_tokens

    named = [{"name": "tool_use", "template": "{{ 'T' }}"}, {"name": "rag", "template": "R"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    with pytest.raises(DamagedFileError, match=r"chat_template: no 'default' among tool_use, rag"):
        chat.template(tmp_path)
    named.append({"name": "default", "template": "D"})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert folder_tokens.chat_template(tmp_path) == "D"


def test_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """Latin-1 text is refused by its first bad byte and line (as bytes.decode finds
    it), not only as 'a binary file' with advice about token ids."""
    (tmp_path / "notes.txt").write_bytes("ok\nstill ok\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "c.jsonl").write_bytes(b'{"messages": []}\n{"messages": "\xff"}\n')
    for name, line, byte in [("notes.txt", 3, "e9"), ("c.jsonl", 2, "ff")]:
        with pytest.raises(data.DataError, match=f"{name}: .*byte 0x{byte} on line {line} "):
            corpora.load(str(tmp_path / name), fmt="chat" if name == "c.jsonl" else "auto")


def test_an_empty_file_in_a_folder_adds_no_line(tmp_path):
    for name, text in [("a.txt", "one"), ("b.txt", ""), ("c.jsonl", ""), ("d.txt", "two")]:
        (tmp_path / name).write_text(text)
    assert datasets.read(tmp_path) == "one\ntwo"  # as `cat` of each with a newline


def test_a_lone_surrogate_is_refused_naming_the_line(tmp_path):
    """JSON's "\\ud83d" without its pair is no character (str.encode refuses it); it
    was read, then failed as a raw UnicodeEncodeError or TypeError at tokenizing."""
    half = "half \ud83d emoji"  # json.dumps writes it as the escape: the file is ASCII
    rows = [{"text": "fine"}, {"text": half}]
    (tmp_path / "t.jsonl").write_text("\n".join(map(json.dumps, rows)))
    conv = [{"role": "user", "content": half}, CONV[1]]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": conv}))
    for name, where in [("t.jsonl", "t.jsonl:2: the 'text' field"),
                        ("c.jsonl", "c.jsonl:1: message 0's content")]:  # fmt: skip
        with pytest.raises(data.DataError, match=rf"{where} holds a lone surrogate \\ud83d at "):
            corpora.load(str(tmp_path / name))


def test_added_tokens_listed_beside_vocab_json_are_read_at_their_ids(bpe, tmp_path):
    """A vocab.json + merges.txt folder whose fine-tune added <|im_start|> lists it in
    tokenizer_config.json's added_tokens_decoder, or (older) added_tokens.json: the
    ids are transformers' (they were the marker's text in pieces, the vocabulary short)."""
    from tokenizers import Tokenizer

    from models.families.common import DamagedFileError
    from models.io import folder_tokens

    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_str(bpe)
    tok.model.save(str(tmp_path))  # vocab.json, merges.txt
    n = tok.get_vocab_size()
    added = {"<|endoftext|>": n, "<|im_start|>": n + 1, "<tool>": n + 2}
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
    text = "<|im_start|>user\nWhat does assert do?<tool><|endoftext|>"
    decoder = {str(i): {"content": t, "special": t != "<tool>"} for t, i in added.items()}
    for listed in ({"added_tokens_decoder": decoder}, {}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | listed))
        (tmp_path / "added_tokens.json").write_text(json.dumps({} if listed else added))
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
        ours = folder_tokens.read(tmp_path)
        want = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == want
        assert want[0] == n + 1 and ours.get_vocab_size() == len(theirs) == n + 3
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<tool>": n + 5}))  # a gap
    with pytest.raises(DamagedFileError, match=rf"'<tool>' is listed with id {n + 5}, but "):
        folder_tokens.read(tmp_path)


def test_a_tokenizer_folder_for_a_file_is_refused_naming_the_file(tmp_path):
    """--tokenizer hf/model (a folder) said the file 'does not exist'."""
    with pytest.raises(data.DataError, match="is a folder without a tokenizer.json"):
        data.load_tokenizer_file(tmp_path)
    data.ByteTokenizer().save(tmp_path)
    with pytest.raises(data.DataError, match=f"folder: pass the file, --tokenizer {tmp_path}/"):
        data.load_tokenizer_file(tmp_path)


def test_a_base_copy_keeps_every_file_the_tokenizer_reads():
    """A fine-tune's RUN/base (hub.BASE_FILES) held no added_tokens.json or vocab.txt, so
    a run read another tokenizer than its base folder: every file name folder_tokens.py
    opens is one it lists, and the copy takes them all."""
    import re
    from pathlib import Path

    from models.io import folder_tokens, hub

    source = Path(folder_tokens.__file__).read_text()
    opened = set(re.findall(r'"([a-z_]+\.(?:json|txt|model|jinja))"', source))
    assert opened <= set(folder_tokens.READS)
    assert set(folder_tokens.READS) <= set(hub.BASE_FILES)
