"""A Hugging Face folder's tokenizer, special tokens and chat template.

The tokenizer is read from, in order: `tokenizer.json` (the `tokenizers` package's own
file); `vocab.json` + `merges.txt` (a byte-level BPE, GPT-2's and RoBERTa's, read by
`tokenizers.models.BPE.from_file`); a SentencePiece `tokenizer.model` (its protobuf read
with transformers' bundled `sentencepiece_model_pb2` and turned into a `tokenizers`
Tokenizer by `SpmConverter.build_tokenizer_from_spm_proto`, which follows the model's
own normalizer spec: the `sentencepiece` package is not needed); BERT's WordPiece
`vocab.txt` ([CLS] text [SEP]). Each becomes a
`tokenizers.Tokenizer`, so a run saves it as one tokenizer.json; the added tokens the
folder lists beside the three latter (tokenizer_config.json's added_tokens_decoder,
added_tokens.json) are added at their ids. Where the family adds
<s> / </s> around a text (`Family.tokens`), a tokenizer made from vocab.json or
tokenizer.model gets that post-processor; tokenizer.json carries its own.

EOS ids come from generation_config.json, else config.json; the chat template from
chat_template.jinja or tokenizer_config.json's `chat_template`, rendered with jinja2's
sandbox as transformers renders it, within bounds of work and memory (models/io/sandbox.py).

A damaged file (a tokenizer that `tokenizers` cannot read, JSON that is not an object,
an option or id of the wrong type) is a `DamagedFileError` naming it, a template that
fails or exceeds its bounds a `ChatTemplateError` naming its file: never a traceback."""

from __future__ import annotations

from pathlib import Path

from models.families import FAMILIES
from models.families.common import (
    ChatTemplateError,
    DamagedFileError,
    HubError,
    MissingFileError,
    UnsupportedModelError,
)
from models.io import files

# the files a tokenizer is read from, in the order they are tried (for error messages)
FILES = ("tokenizer.json", "vocab.json + merges.txt", "tokenizer.model", "vocab.txt")
# every file `read` and `template` may open: a copy of a folder's tokenizer (a
# fine-tune's RUN/base, hub.BASE_FILES) must hold them all to read as the folder reads
READS = (
    "tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
    "added_tokens.json", "tokenizer_config.json", "special_tokens_map.json",
    "generation_config.json", "config.json", "chat_template.jinja",
)  # fmt: skip


def read(folder, family: str | None = None):
    """The folder's tokenizer as a `tokenizers.Tokenizer`, or None when it has none of
    FILES (callers that need one use `required`); DamagedFileError naming the file
    when it cannot be read."""
    folder = Path(folder)
    try:
        return _read(folder, family)
    except HubError:
        raise
    except Exception as e:  # tokenizers' and protobuf's own exception types
        raise DamagedFileError(
            f"{folder}/{source(folder)}: not a tokenizer that can be read ({_first_line(e)})"
        ) from None


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0][:200] if lines else "") or type(e).__name__


def _read(folder: Path, family: str | None):
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
        tok, named = _byte_level_bpe(folder), {}
    elif (folder / "tokenizer.model").exists():
        tok, named = _sentencepiece(folder)
    elif (folder / "vocab.txt").exists():
        return _add_listed(_wordpiece(folder), folder)  # [CLS] text [SEP], whatever the family
    else:
        return None
    wants = FAMILIES[family].tokens if family in FAMILIES else ()
    return _add_specials(_add_listed(tok, folder), folder, wants, named)


def _add_listed(tok, folder: Path):
    """The tokenizer with the added tokens the folder lists beside its vocabulary
    (tokenizer_config.json's added_tokens_decoder, else added_tokens.json: a
    fine-tune's <|im_start|>), each at its listed id, matched whole as transformers
    matches it; DamagedFileError when one cannot have its id."""
    from tokenizers import AddedToken

    listed = _listed_tokens(folder)
    for i, (text, flags) in sorted(listed.items()):
        token = AddedToken(text, **flags)
        tok.add_special_tokens([token]) if flags["special"] else tok.add_tokens([token])
        if tok.token_to_id(text) != i:
            raise DamagedFileError(
                f"{folder}: added token {text!r} is listed with id {i}, but the vocabulary "
                f"gives it {tok.token_to_id(text)} (ids listed out of order, or past a gap)"
            )
    return tok


def _listed_tokens(folder: Path) -> dict[int, tuple[str, dict]]:
    """{id: (text, AddedToken's flags)} of tokenizer_config.json's added_tokens_decoder,
    else (as transformers reads a folder) of added_tokens.json ({text: id}: special
    where tokenizer_config.json names it a special token); DamagedFileError naming the
    file for an entry of the wrong form."""
    keys = ("single_word", "lstrip", "rstrip", "normalized", "special")
    decoder = _tokenizer_config(folder).get("added_tokens_decoder")
    if decoder is None:
        named = {special_token(folder, f"{k}_token") for k in SPECIAL_NAMES}
        decoder = {}
        for text, i in _json_file(folder / "added_tokens.json").items():
            if not isinstance(i, int) or isinstance(i, bool):
                raise DamagedFileError(f"{folder}/added_tokens.json: {text!r} has id {i!r:.20}")
            decoder[str(i)] = {"content": text, "special": text in named}
    out = {}
    for k, v in decoder.items() if isinstance(decoder, dict) else [(None, decoder)]:
        if not (str(k).isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise DamagedFileError(
                f"{folder}/tokenizer_config.json: added_tokens_decoder must map ids to "
                f'{{"content": text, ...}}, got {k!r:.20}: {v!r:.60}'
            )
        flags = {f: bool(v.get(f, f == "normalized" and not v.get("special"))) for f in keys}
        out[int(k)] = (v["content"], flags)
    return out


SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # transformers' attributes


def required(folder, family: str | None, flag: str):
    """`read`, or MissingFileError naming `flag` and the files looked for."""
    tok = read(folder, family)
    if tok is None:
        raise MissingFileError(
            f"{flag}: {folder} holds no tokenizer ({', '.join(FILES)}); copy the model's "
            "tokenizer files into it"
        )
    return tok


def _byte_level_bpe(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _wordpiece(folder: Path):
    """BERT's and DistilBERT's WordPiece vocab.txt, built as tokenizers'
    BertWordPieceTokenizer builds it: [CLS] text [SEP], lower-cased unless
    tokenizer_config.json's do_lower_case is false."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    lower = _option(folder, "do_lower_case", True)
    tok = Tokenizer(models.WordPiece.from_file(str(folder / "vocab.txt"), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    marks = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]")}
    if None in marks.values():
        raise MissingFileError(f"{folder}/vocab.txt has no [CLS] or [SEP] token: not BERT's")
    tok.post_processor = processors.BertProcessing(
        ("[SEP]", marks["[SEP]"]), ("[CLS]", marks["[CLS]"])
    )
    tok.add_special_tokens(["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"])
    return tok


def _sentencepiece(folder: Path):
    from tokenizers import AddedToken

    try:
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    except ImportError:
        raise UnsupportedModelError(
            f"{folder}/tokenizer.model: reading a SentencePiece model needs transformers and "
            "protobuf (pip install 'namedmesh[sentencepiece]'), or give the folder a "
            "tokenizer.json"
        ) from None

    proto = import_protobuf().ModelProto()
    proto.ParseFromString((folder / "tokenizer.model").read_bytes())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    vocab = (
        {p: i for i, (p, _) in enumerate(pieces)} if proto.trainer_spec.model_type == 2 else pieces
    )
    legacy = _option(folder, "legacy", True)
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=legacy)
    if tok is None:
        raise MissingFileError(
            f"{folder}/tokenizer.model: SentencePiece model type "
            f"{proto.trainer_spec.model_type} is neither unigram (1) nor BPE (2)"
        )
    control = [p.piece for p in proto.pieces if p.type in (2, 3)]  # unknown, control
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in control])
    spec, n = proto.trainer_spec, len(proto.pieces)
    ids = {"bos": spec.bos_id, "eos": spec.eos_id}  # -1: the model has none
    return tok, {k: proto.pieces[i].piece for k, i in ids.items() if 0 <= i < n}


def _json_file(path: Path) -> dict:
    """The JSON object of a folder's file ({} when it does not exist); DamagedFileError
    naming it when it is not one (not JSON, a list)."""
    if not path.exists():
        return {}
    try:
        return files.read_json(path, path.name)
    except files.FileReadError as e:
        raise DamagedFileError(str(e)) from None


def _tokenizer_config(folder: Path) -> dict:
    return _json_file(Path(folder) / "tokenizer_config.json")


def _option(folder, key: str, default: bool) -> bool:
    """tokenizer_config.json's true/false `key`; DamagedFileError when it is not one."""
    value = _tokenizer_config(folder).get(key, default)
    if not isinstance(value, bool):
        raise DamagedFileError(
            f"{folder}/tokenizer_config.json: {key} must be true or false, got {value!r:.60}"
        )
    return value


def token_ids(value, where: str) -> list[int]:
    """An id or a list of ids of a config file (ints, never bools or text);
    DamagedFileError naming `where` otherwise."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise DamagedFileError(f"{where}: expected a token id or a list of ids, got {value!r:.60}")
    return items


def special_token(folder, name: str) -> str | None:
    """The text of tokenizer_config.json's (or special_tokens_map.json's) `name`
    ("bos_token", "eos_token"), which may be stored as {"content": text}."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        value = _json_file(Path(folder) / file).get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise DamagedFileError(
                f'{folder}/{file}: {name} must be a token\'s text or {{"content": text}}, got '
                f"{value!r:.60}"
            )
        if value:
            return value
    return None


def _add_specials(tok, folder: Path, wants: tuple[str, ...], named: dict):
    """The post-processor that puts the family's `wants` ("bos", "eos") around a text:
    the tokens tokenizer_config.json names, else those the tokenizer's file `named`."""
    from tokenizers import processors

    if not wants:
        return tok
    ids = {}
    for kind in wants:
        if not _option(folder, f"add_{kind}_token", True):
            continue
        text = special_token(folder, f"{kind}_token") or named.get(kind)
        if text is None or tok.token_to_id(text) is None:
            raise MissingFileError(
                f"{folder}: the family adds a {kind} token, but tokenizer_config.json names "
                f"none in the vocabulary ({kind}_token={text!r})"
            )
        ids[kind] = (text, tok.token_to_id(text))
    parts = [ids["bos"][0]] if "bos" in ids else []
    single = " ".join([*parts, "$A", *([ids["eos"][0]] if "eos" in ids else [])])
    tok.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=list(ids.values())
    )
    return tok


def eos_ids(folder) -> list[int]:
    """The end-of-sequence ids of generation_config.json, else config.json (an int or a
    list in either); [] when neither names one."""
    for file in ("generation_config.json", "config.json"):
        value = _json_file(Path(folder) / file).get("eos_token_id")
        if value is not None:
            return token_ids(value, f"{folder}/{file}: eos_token_id")
    return []


def chat_template(folder) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template} whose "default" is used;
    DamagedFileError for a list without one, as transformers refuses it)."""
    return _template(Path(folder))[0]


def _template(folder: Path) -> tuple[str | None, str]:
    """(the chat template, the file it is read from, for messages)."""
    path = folder / "chat_template.jinja"
    if path.exists():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError:
            raise DamagedFileError(f"{path}: not UTF-8 text") from None
    where = f"{folder}/tokenizer_config.json's chat_template"
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        if not all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in template):
            raise DamagedFileError(f"{where}: a list must hold {{name, template}} objects")
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:  # transformers refuses it too: which is meant is unknown
            raise DamagedFileError(
                f"{where}: no 'default' among {', '.join(map(str, named))}; name one 'default'"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise DamagedFileError(f"{where}: must be a template's text, got {template!r:.60}")
    return template, where


def apply_chat(folder, prompt: str, flag: str = "--chat") -> str:
    """The prompt as the folder's chat template renders one user message followed by
    the assistant's turn (add_generation_prompt), in a jinja2 sandbox with bounded work
    and memory (models/io/sandbox.py); ChatTemplateError naming the template's file for
    any failure, MissingFileError for a folder without a template."""
    from models.io import sandbox  # jinja2, imported when a template is rendered

    template, where = _template(Path(folder))
    if template is None:
        raise MissingFileError(
            f"{flag}: {folder} has no chat template (chat_template.jinja or tokenizer_config."
            "json's chat_template): it is not an instruct model's folder"
        )
    try:
        return sandbox.render(
            template,
            messages=[{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=special_token(folder, "bos_token") or "",
            eos_token=special_token(folder, "eos_token") or "",
        )
    except sandbox.TemplateFailure as e:
        raise ChatTemplateError(f"{flag}: the chat template {where} fails: {e}") from None


def source(folder) -> str:
    """Which of FILES the folder's tokenizer is read from (for run.json and headers)."""
    folder = Path(folder)
    for name in FILES:
        if all((folder / f).exists() for f in name.split(" + ")):
            return name
    return "none"
