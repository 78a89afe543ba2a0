"""A Hugging Face folder's tokenizer, EOS and chat template (models/io/folder_tokens.py):
vocab.json + merges.txt encode as transformers' GPT-2 and RoBERTa tokenizers do (RoBERTa
with its <s> ... </s>); a SentencePiece tokenizer.model built by hand encodes to the
ids worked out by hand; EOS ids, --eos as text and --chat's rendering equal what the
files and transformers say; a folder without a tokenizer is refused in one line."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.cli import generate  # noqa: E402
from models.families.common import MissingFileError  # noqa: E402
from models.io import folder_tokens  # noqa: E402
from models.training import data  # noqa: E402

TEXTS = ["The assert statement", "  spaces,\tand\nnewlines  ", "ünïcödé ✓ 12345"]
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """vocab.json + merges.txt of a byte-level BPE with RoBERTa's special tokens."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    text = data.split(data.load_text())[0][:40_000]
    tok.train_from_iterator([text], vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    folder = tmp_path_factory.mktemp("bpe")
    tok.save_model(str(folder))
    return folder


def test_vocab_and_merges_encode_as_transformers_gpt2_and_roberta(bpe_folder):
    gpt2 = transformers.GPT2Tokenizer(
        str(bpe_folder / "vocab.json"), str(bpe_folder / "merges.txt")
    )
    roberta = transformers.RobertaTokenizer(
        str(bpe_folder / "vocab.json"), str(bpe_folder / "merges.txt")
    )
    (bpe_folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    ours_gpt2 = folder_tokens.read(bpe_folder, "gpt2")
    ours_roberta = folder_tokens.read(bpe_folder, "roberta")
    for text in TEXTS:
        assert ours_gpt2.encode(text).ids == gpt2(text)["input_ids"]
        assert ours_roberta.encode(text).ids == roberta(text)["input_ids"]
        assert ours_gpt2.decode(ours_gpt2.encode(text).ids) == text
    assert folder_tokens.source(bpe_folder) == "vocab.json + merges.txt"


def sentencepiece_folder(folder):
    """A unigram SentencePiece model written as its protobuf: ids 0 <unk>, 1 <s>, 2 </s>,
    3 ▁hello, 4 ▁world, 5 ▁, then the letters h e l o w r d (6..12)."""
    from transformers.convert_slow_tokenizer import import_protobuf

    pb = import_protobuf()
    m = pb.ModelProto()
    kinds = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    kinds += [("▁hello", -1.0, 1), ("▁world", -1.0, 1), ("▁", -2.0, 1)]
    kinds += [(c, -5.0, 1) for c in "helowrd"]
    for piece, score, kind in kinds:
        m.pieces.add(piece=piece, score=score, type=kind)
    m.trainer_spec.model_type, m.trainer_spec.unk_id = 1, 0
    m.trainer_spec.bos_id, m.trainer_spec.eos_id = 1, 2
    spec = m.normalizer_spec
    spec.name, spec.add_dummy_prefix = "identity", True
    spec.remove_extra_whitespaces, spec.escape_whitespaces = True, True
    (folder / "tokenizer.model").write_bytes(m.SerializeToString())
    return folder


def test_a_sentencepiece_model_encodes_as_worked_out_by_hand(tmp_path):
    folder = sentencepiece_folder(tmp_path)
    llama, t5 = folder_tokens.read(folder, "llama"), folder_tokens.read(folder, "t5")
    assert llama.encode("hello world").ids == [1, 3, 4]  # Llama: <s> first
    assert t5.encode("hello  world").ids == [3, 4, 2]  # T5: </s> last; spaces collapsed
    assert t5.encode("hello wd").ids == [3, 5, 10, 12, 2]  # ▁wd: ▁ w d
    assert llama.decode([1, 3, 4]) == "hello world"
    assert folder_tokens.source(folder) == "tokenizer.model"


def test_eos_comes_from_generation_config_then_config_and_eos_takes_text(bpe_folder, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert folder_tokens.eos_ids(tmp_path) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert folder_tokens.eos_ids(tmp_path) == [2, 7]
    tok = data.BPETokenizer(folder_tokens.read(bpe_folder, "gpt2"))
    assert generate.eos_of(None, tok, tmp_path) == [2, 7]
    assert generate.eos_of("</s>", tok, tmp_path) == [tok.tok.token_to_id("</s>")] == [2]
    assert generate.eos_of("13", tok, tmp_path) == [13] and generate.eos_of("none", tok, None) == []
    with pytest.raises(generate.ParameterError, match="'<eot>' is neither a token id nor"):
        generate.eos_of("<eot>", tok, tmp_path)


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_renders_the_folders_template_as_transformers_does(bpe_folder, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=folder_tokens.read(bpe_folder, "gpt2"), bos_token="<s>",
        eos_token="</s>", chat_template=TEMPLATE,
    )  # fmt: skip
    fast.save_pretrained(tmp_path)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=False
    )
    assert folder_tokens.apply_chat(tmp_path, "Hi there") == want
    tok = data.BPETokenizer(folder_tokens.read(tmp_path))
    ids = generate.encode_prompts(["Hi there"], tok, tmp_path, chat=True)[0]
    assert ids[0] == 0 and tok.decode(ids) == want.replace("<s>", "").replace("</s>", "")
    with pytest.raises(MissingFileError, match="--chat: .* has no chat template"):
        folder_tokens.apply_chat(bpe_folder, "Hi")


def test_a_folder_without_a_tokenizer_is_refused_by_generate_and_init_from(tmp_path, capsys):
    from models.cli.train import main as train

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    files = "no tokenizer (tokenizer.json, vocab.json + merges.txt, tokenizer.model, vocab.txt)"
    assert generate.main([str(tmp_path / "llama"), "--max-new", "2"]) == 2
    assert files in capsys.readouterr().err
    flags = ["--init-from", str(tmp_path / "llama"), "--steps", "1", "--out", str(tmp_path / "o")]
    assert train(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--init-from:" in err and "holds no tokenizer" in err


def test_a_wordpiece_vocab_txt_encodes_as_transformers_bert(tmp_path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "as", "##sert", "state"]
    words += ["##ment", ",", "a", "##s", "list", "of", "x"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    bert = transformers.BertTokenizer(str(tmp_path / "vocab.txt"))
    ours = folder_tokens.read(tmp_path, "distilbert")
    for text in ("The Assert statement, as a list of xs", "the unknown word"):
        assert ours.encode(text).ids == bert(text)["input_ids"]
    assert ours.decode(ours.encode("the assert statement").ids) == "the assert statement"
