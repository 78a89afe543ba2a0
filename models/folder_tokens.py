"""A Hugging Face folder's tokenizer, special tokens and chat template.

The tokenizer is read from, in order: `tokenizer.json` (the `tokenizers` package's own
file); `vocab.json` + `merges.txt` (a byte-level BPE, GPT-2's and RoBERTa's, read by
`tokenizers.models.BPE.from_file`); a SentencePiece `tokenizer.model` (its protobuf read
with transformers' bundled `sentencepiece_model_pb2` and turned into a `tokenizers`
Tokenizer by `SpmConverter.build_tokenizer_from_spm_proto`, which follows the model's
own normalizer spec: the `sentencepiece` package is not needed); BERT's WordPiece
`vocab.txt` ([CLS] text [SEP]). Each becomes a
`tokenizers.Tokenizer`, so a run saves it as one tokenizer.json. Where the family adds
<s> / </s> around a text (`Family.tokens`), a tokenizer made from vocab.json or
tokenizer.model gets that post-processor; tokenizer.json carries its own.

EOS ids come from generation_config.json, else config.json; the chat template from
chat_template.jinja or tokenizer_config.json's `chat_template`, rendered with jinja2's
sandbox as transformers renders it."""

from __future__ import annotations

import json
from pathlib import Path

from models.families import FAMILIES
from models.families.common import MissingFileError, UnsupportedModelError

# the files a tokenizer is read from, in the order they are tried (for error messages)
FILES = ("tokenizer.json", "vocab.json + merges.txt", "tokenizer.model", "vocab.txt")


def read(folder, family: str | None = None):
    """The folder's tokenizer as a `tokenizers.Tokenizer`, or None when it has none of
    FILES (callers that need one use `required`)."""
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    if (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
        tok, named = _byte_level_bpe(folder), {}
    elif (folder / "tokenizer.model").exists():
        tok, named = _sentencepiece(folder)
    elif (folder / "vocab.txt").exists():
        return _wordpiece(folder)  # BERT's [CLS] text [SEP], whatever the family
    else:
        return None
    wants = FAMILIES[family].tokens if family in FAMILIES else ()
    return _add_specials(tok, folder, wants, named)


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

    lower = _tokenizer_config(folder).get("do_lower_case", True)
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
    legacy = _tokenizer_config(folder).get("legacy", True)
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


def _tokenizer_config(folder: Path) -> dict:
    path = Path(folder) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def special_token(folder, name: str) -> str | None:
    """The text of tokenizer_config.json's (or special_tokens_map.json's) `name`
    ("bos_token", "eos_token"), which may be stored as {"content": text}."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        path = Path(folder) / file
        value = json.loads(path.read_text()).get(name) if path.exists() else None
        if isinstance(value, dict):
            value = value.get("content")
        if value:
            return value
    return None


def _add_specials(tok, folder: Path, wants: tuple[str, ...], named: dict):
    """The post-processor that puts the family's `wants` ("bos", "eos") around a text:
    the tokens tokenizer_config.json names, else those the tokenizer's file `named`."""
    from tokenizers import processors

    if not wants:
        return tok
    config = _tokenizer_config(folder)
    ids = {}
    for kind in wants:
        if config.get(f"add_{kind}_token") is False:
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
        path = Path(folder) / file
        value = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    return []


def chat_template(folder) -> str | None:
    """The folder's chat template: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or a list of {name, template} whose "default" is used)."""
    path = Path(folder) / "chat_template.jinja"
    if path.exists():
        return path.read_text(encoding="utf-8")
    template = _tokenizer_config(folder).get("chat_template")
    if isinstance(template, list):
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template


def apply_chat(folder, prompt: str, flag: str = "--chat") -> str:
    """The prompt as the folder's chat template renders one user message followed by
    the assistant's turn (add_generation_prompt), in jinja2's immutable sandbox."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = chat_template(folder)
    if template is None:
        raise MissingFileError(
            f"{flag}: {folder} has no chat template (chat_template.jinja or tokenizer_config."
            "json's chat_template): it is not an instruct model's folder"
        )

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=special_token(folder, "bos_token") or "",
            eos_token=special_token(folder, "eos_token") or "",
        )
    except TemplateError as e:
        raise MissingFileError(f"{flag}: {folder}'s chat template fails: {e}") from None


def source(folder) -> str:
    """Which of FILES the folder's tokenizer is read from (for run.json and headers)."""
    folder = Path(folder)
    for name in FILES:
        if all((folder / f).exists() for f in name.split(" + ")):
            return name
    return "none"
