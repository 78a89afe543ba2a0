"""Chat data (models/training/chat.py): the tokens of a folder's chat template are transformers'
`apply_chat_template`'s and the weights its assistant mask (of the template's
`{% generation %}` tags, which our rendering ignores); `eval` of chat data is the
masked loss computed in NumPy from transformers' logits (packed rows: GPT-2's learned
positions restart per example); a packed row's logits are its examples' run alone under
every kernel that takes the mask (ring refuses it by name); bad lines are DataErrors
naming file and line."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import namedmesh as nm  # noqa: E402
from models import transformer  # noqa: E402
from models.architecture import Config, ConfigError  # noqa: E402
from models.io import folder_tokens  # noqa: E402
from models.training import chat, corpora, data  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message comes first') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Zephyr's layout: role markers that are not special tokens, turns closed by eos_token
ZEPHYR = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] + eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
CHATS = [
    [{"role": "user", "content": "What does assert do?"},
     {"role": "assistant", "content": "It raises AssertionError."}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Name a loop."},
     {"role": "assistant", "content": "for"},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "while, of course"}],
    [{"role": "user", "content": "Say ok"}, {"role": "assistant", "content": "ok"}],
    [{"role": "user", "content": "Is the  spacing\tkept?"},
     {"role": "assistant", "content": " Yes:\n  it is."}],
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tokenizer folder (a byte-level BPE with ChatML's special tokens, ChatML's
    template) holding a tiny GPT-2 too; (folder, transformers' tokenizer, its model)."""
    out = tmp_path_factory.mktemp("chat")
    tok = data.BPETokenizer.train(data.split(data.load_text())[0][:20_000], 300).tok
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "<|endoftext|>",
              "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                  vocab_size=tok.get_vocab_size())  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    return out, transformers.AutoTokenizer.from_pretrained(out), model


def theirs(tf_tok, messages, template):
    """(ids, assistant mask) of transformers' apply_chat_template."""
    out = tf_tok.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], np.float32)


@pytest.mark.parametrize("template", [CHATML, ZEPHYR], ids=["chatml", "zephyr"])
def test_tokens_and_weights_are_apply_chat_templates(folder, template):
    path, tf_tok, _ = folder
    ours = chat.template(path)._replace(source=template)  # its {% generation %} tags ignored
    tok = data.BPETokenizer(folder_tokens.read(path))
    for messages in CHATS:
        ids, weights = chat.encode(messages, ours, tok, "x.jsonl:1")
        want_ids, want_mask = theirs(tf_tok, messages, template)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(weights, want_mask)
        assert weights.sum() > 0


def test_eval_of_chat_data_is_the_masked_loss_of_transformers_logits(folder, tmp_path, capsys):
    """The examples packed into rows of 96 positions (several per row): eval's loss is
    the assistant tokens' mean NLL of each example run alone in transformers."""
    from models.cli import evaluate

    path, tf_tok, model = folder
    lines = [{"messages": m} for m in CHATS * 3]
    file = tmp_path / "chat.jsonl"
    file.write_text("\n".join(map(json.dumps, lines)) + "\n")
    nll, count = 0.0, 0
    for messages in CHATS * 3:
        ids, mask = theirs(tf_tok, messages, CHATML)
        with torch.no_grad():
            logits = model(torch.tensor(ids[None])).logits[0].double().numpy()
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        picked = logp[np.arange(len(ids) - 1), ids[1:]]
        nll -= (picked * mask[1:]).sum()
        count += int(mask[1:].sum())
    args = evaluate.arguments([str(path), "--data", str(file), "--length", "96", "--batch", "2",
                               "--quiet"])  # fmt: skip
    out = evaluate.evaluate(args)
    assert out["tokens"] == count
    assert out["loss"] == pytest.approx(nll / count, rel=2e-5)
    rows = corpora.make(chat.read(file), data.BPETokenizer(folder_tokens.read(path)), 96,
                       valid=chat.read(file), folder=path).valid  # fmt: skip
    assert out["windows"] == len(rows["inputs"]) < len(lines)  # packed: fewer rows than examples


def _logits(cfg, params, batch):
    tensors = {k: nm.tensor(v, ("batch", "length")) for k, v in batch.items()}
    packed = {k: tensors[k] for k in ("inputs", "segments", "positions") if k in tensors}
    return transformer.lm_forward(params, packed, cfg)[0].data


ROTARY = Config(vocab=64, d_model=32, heads=4, kv_heads=2, d_kv=8, d_ff=64, layers=1, length=20,
                batch=1, positions="rotary", sliding_window=5, attention_block=4)  # fmt: skip


@pytest.fixture(scope="module")
def params():
    return jax.jit(lambda: transformer.init(transformer.lm_shapes(ROTARY), 1))()


def test_a_packed_row_is_its_examples_run_alone(params):
    """Rotary positions, a sliding window, grouped heads, blocks of 4 keys: under the
    full, blockwise and fused kernels (one program), the logits of each example in a
    packed row are its logits in a row of its own."""
    rng = np.random.default_rng(0)
    lengths = (6, 9, 4)
    examples = [(rng.integers(0, 50, n), np.ones(n, np.float32)) for n in lengths]
    row = chat.pack(examples, 20)
    # each example in a row of its own, from position 0, without segments or positions
    alone = {"inputs": np.concatenate([chat.pack([e], 20)["inputs"] for e in examples])}
    kinds = [ROTARY.replace(attention=a) for a in ("full", "blockwise", "fused")]
    run = jax.jit(lambda p: (_logits(ROTARY, p, alone), [_logits(c, p, row) for c in kinds]))
    each, rows = run(params)
    for packed in rows:
        at = 0
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(packed[0, at : at + n - 1], each[i, : n - 1], atol=2e-5)
            at += n - 1
    assert (row["segments"][0, at:] == 0).all() and row["positions"][0, 5] == 0


def test_ring_attention_refuses_packed_rows_by_name(params):
    row = chat.pack([(np.arange(5), np.ones(5, np.float32))] * 2, 8)
    ring = ROTARY.replace(attention="ring", sliding_window=0)
    with pytest.raises(ConfigError, match="attention='ring' with pairwise.*'full'"):
        jax.eval_shape(lambda p: _logits(ring, p, row), params)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "hi"}', "no 'messages' field \\(has text\\)"),
        ('{"messages": [{"role": "robot", "content": "x"}]}',
         "message 0 has role 'robot', not one of system"),
        ("{not json", "not a JSON line"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}',
         "message 0's content must be text"),
    ],
)  # fmt: skip
def test_a_bad_line_is_a_data_error_naming_file_and_line(tmp_path, line, message):
    file = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": CHATS[2]})
    file.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(data.DataError, match=f"--data {file}:3: {message}"):
        corpora.load(str(file), fmt="chat")


def test_the_command_line_says_a_bad_line_and_a_failing_template_in_one_line(
    folder, tmp_path, capsys
):
    from models.cli.train import main

    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps({"messages": CHATS[0]}) + "\n{oops\n")
    assert main(["--data", str(file), "--out", str(tmp_path / "run"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{file}:2: not a JSON line" in err
    # ChatML's template refuses a system message after the first: the error names the line
    late = [CHATS[0][0], {"role": "system", "content": "late"}, CHATS[0][1]]
    file.write_text(f"{json.dumps({'messages': CHATS[0]})}\n{json.dumps({'messages': late})}\n")
    tok = data.BPETokenizer(folder_tokens.read(folder[0]))
    with pytest.raises(data.DataError, match=f"{file}:2: .*chat template fails.*comes first"):
        corpora.make(chat.read(file), tok, 40, folder=folder[0])


def test_long_examples_are_cut_and_the_validation_split_is_the_last_tenth(tmp_path, capsys):
    """Bytes and the default template; 20 conversations: line 1 too long for a row,
    line 2's assistant tokens all past a row's end (left out), then 18 of 69 tokens."""
    long = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * 200}]
    late = [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "a"}]
    chats = [long, late] + [CHATS[2]] * 18
    file = tmp_path / "chat.jsonl"
    file.write_text("\n".join(json.dumps({"messages": m}) for m in chats))
    tok = data.ByteTokenizer()
    corpus = corpora.make(corpora.load(str(file)), tok, 128)
    said = capsys.readouterr().out
    assert "2 conversation(s) longer than --length 128 + 1 tokens cut to it (lines 1, 2)" in said
    assert "1 kept no assistant token" in said
    text = "<|im_start|>user\nSay ok<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
    assert chat.render(chat.template(None), CHATS[2], False, "") == text
    # the last tenth, two conversations of 69 tokens, in two rows of 128
    assert corpus.valid["inputs"].shape == (2, 128)
    assert (corpus.valid["segments"] > 0).sum() == 2 * (len(text) - 1)
    learnt = sum(b["weights"].sum() for b in corpus.validation_batches(4))
    assert learnt == 2 * len("ok<|im_end|>") == corpus.valid_tokens
    cut = corpus.train["segments"][0] == 1  # line 1, cut to 129 tokens: a row of its own
    assert cut.all() and corpus.train["weights"][0, -1] == 1
    # every train row once per epoch, in an order of the seed
    rows = len(corpus.train["inputs"])
    seen = np.concatenate([corpus.batch(s, 1, 0)["inputs"] for s in range(rows)])
    assert sorted(r.tobytes() for r in seen) == sorted(r.tobytes() for r in corpus.train["inputs"])
    with pytest.raises(data.DataError, match="chat data trains decoder LMs.*not the 'mlm'"):
        corpora.make(corpora.load(str(file)), tok, 128, "mlm")


def test_the_template_is_the_fine_tunes_base_or_the_tokenizers_folder(folder, tmp_path):
    """train: --init-from's folder (a resume's copy of it, OUT/base), a --tokenizer
    FILE's folder, none for byte and bpe (the default template); eval: the same of a
    run, a Hugging Face folder itself."""
    from types import SimpleNamespace

    from models.cli import evaluate
    from models.training import run

    path = folder[0]
    out = tmp_path / "run"
    (out / "base").mkdir(parents=True)
    (out / "base" / "config.json").write_text("{}")
    args = lambda **kw: SimpleNamespace(**{"init_from": None, "out": str(out), "resume": False,
                                           "tokenizer": "byte"} | kw)  # fmt: skip
    assert run.template_folder(args(init_from=str(path))) == path
    assert run.template_folder(args(init_from=str(path), resume=True)) == out / "base"
    assert run.template_folder(args(tokenizer=str(path / "tokenizer.json"))) == path
    assert (
        run.template_folder(args()) is None and run.template_folder(args(tokenizer="bpe")) is None
    )
    assert evaluate.template_folder(str(path)) == path
    (out / "run.json").write_text(json.dumps({"tokenizer": str(path / "tokenizer.json")}))
    assert evaluate.template_folder(str(out)) == out / "base"
    (out / "base" / "config.json").unlink()
    assert evaluate.template_folder(str(out)) == path
    assert chat.template(path).ends == ("<|im_end|>",) and chat.template(tmp_path).where.startswith(
        "the default"
    )
