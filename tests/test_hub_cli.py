"""The command lines on a Hugging Face folder: `models.cli.generate FOLDER`
decodes what transformers decodes; `models.cli.train --init-from FOLDER` starts from the
folder's weights (its first loss is transformers' loss on the same batch), the loss
falls, and the run resumes and decodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import transformer  # noqa: E402
from models.io import hub  # noqa: E402
from models.training import checkpoint, data  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# conftest's XLA_FLAGS (the suite's compile options) and this file's devices (the last wins)
DEVICES = "--xla_force_host_platform_device_count=2"
ENV = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {DEVICES}"}
PROMPT = "The assert statement"


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def tiny_gpt2(out, noise: float):
    """A small GPT-2 folder in `out` with a BPE tokenizer trained on the default corpus,
    its weights moved by `noise` x N(0, 1) from their init (so its tokens vary);
    (out, the transformers model, the tokenizer)."""
    tok = data.BPETokenizer.train(data.split(data.load_text())[0][:60_000], 320)
    cfg = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=tok.vocab_size, n_positions=64
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(out)
    tok.save(out)
    return out, model, tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_gpt2(tmp_path_factory.mktemp("gpt2"), 0.1)


def test_generate_decodes_a_hub_folder_as_transformers_does(folder):
    path, model, tok = folder
    ids = torch.tensor([tok.encode(PROMPT).tolist()])
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    gen = run("models.cli.generate", str(path), "--prompt", PROMPT, "--max-new", "12",
              "--mode", "greedy")  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.rstrip("\n") == PROMPT + tok.decode(want[0, ids.shape[1] :].numpy())


def test_fine_tuning_starts_from_the_folder_falls_resumes_and_decodes(folder, tmp_path, capsys):
    """In process: main() as `python -m` runs it (the subprocess path is tested above)."""
    from models.cli.generate import main as generate
    from models.cli.train import main as train

    path, model, tok = folder
    out = tmp_path / "run"
    flags = ["--init-from", str(path), "--length", "32", "--batch", "8", "--lr", "3e-3",
             "--warmup", "2", "--mesh", "data=2", "--layout", "batch:data;d_ff:data",
             "--eval-every", "100", "--eval-batches", "1", "--save-every", "6", "--quiet",
             "--out", str(out)]  # fmt: skip
    assert train([*flags, "--steps", "12"]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    # Step 1's loss is the loaded weights' loss on the first batch: transformers' too.
    batch = data.Corpus(data.load_text(), tok, 32).batch(1, 8, 0)
    with torch.no_grad():
        logits = model(torch.tensor(batch["inputs"])).logits
        want = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.tensor(batch["targets"]).reshape(-1).long()
        )
    assert losses[0] == pytest.approx(float(want), rel=1e-4)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2
    assert train([*flags, "--steps", "14", "--resume"]) == 0
    assert checkpoint.latest_step(out) == 14
    # The checkpoint keeps the parameters by name with their dims, the optimizer apart.
    stored = checkpoint.read_meta(out)["params"]
    assert stored["layers/attn/q"] == {
        "dims": ["layers", "d_model", "heads", "d_kv"], "shape": [2, 32, 4, 8], "dtype": "float32",
    }  # fmt: skip
    other = transformer.abstract(transformer.lm_shapes(hub.config_of(path)[1].replace(d_ff=64)))
    with pytest.raises(checkpoint.CheckpointError, match="'layers/ffn/wi'.*128.*64"):
        checkpoint.restore_params(out, other)
    capsys.readouterr()
    assert generate([str(out), "--prompt", PROMPT, "--max-new", "5"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


def test_fine_tuning_refuses_an_encoder_decoder_in_one_line(tmp_path):
    cfg = transformers.T5Config(
        d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, vocab_size=300
    )
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path)
    r = run(
        "models.cli.train",
        "--init-from",
        str(tmp_path),
        "--steps",
        "2",
        "--out",
        str(tmp_path / "o"),
    )
    assert r.returncode == 2 and "--init-from" in r.stderr and "t5" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def hf_generate(model, ids, **kw) -> np.ndarray:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(
            torch.tensor(ids), do_sample=False, pad_token_id=0, use_cache=False, **kw
        ).numpy()


def test_generate_decodes_a_prompts_file_as_one_batch(folder, tmp_path, capsys):
    """Two prompts of different lengths, a blank line between: each continuation is what
    transformers writes for that prompt alone; --eos stops a row at that token."""
    from models.cli.generate import main

    path, model, tok = folder
    texts = ["The assert statement", "A list"]
    (tmp_path / "prompts.txt").write_text("\n".join(texts) + "\n")
    wants = []
    for text in texts:
        ids = tok.encode(text).tolist()
        wants.append(hf_generate(model, [ids], max_new_tokens=8)[0, len(ids) :])
    flags = [str(path), "--prompts", str(tmp_path / "prompts.txt"),
             "--max-new", "8", "--max-length", "48"]  # fmt: skip
    assert main(flags) == 0
    lines = capsys.readouterr().out.removesuffix("\n").split("\n\n")  # a blank line between
    assert lines == [t + tok.decode(w) for t, w in zip(texts, wants, strict=True)]
    eos = int(wants[0][3])  # the first prompt's fourth new token ends its row
    assert main([*flags, "--eos", str(eos)]) == 0
    first = list(wants[0])
    assert capsys.readouterr().out.split("\n\n")[0] == texts[0] + tok.decode(
        first[: first.index(eos)]
    )


def test_generate_decodes_a_t5_folder_as_transformers_does(folder, tmp_path, capsys):
    """A T5 folder: each line is encoded once (a padded batch) and the decoder, from its
    start token, cross-attends to the encoding; the text is transformers' output."""
    from models.cli.generate import main

    _, _, tok = folder
    cfg = transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=tok.vocab_size,
        relative_attention_num_buckets=8, relative_attention_max_distance=10,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "t5")
    tok.save(tmp_path / "t5")
    texts = ["The assert statement", "A list of"]
    (tmp_path / "inputs.txt").write_text("\n".join(texts))
    ids = [tok.encode(t).tolist() for t in texts]
    width = max(map(len, ids))
    padded = np.array([i + [0] * (width - len(i)) for i in ids])
    mask = (np.arange(width)[None] < np.array([len(i) for i in ids])[:, None]).astype(np.int64)
    want = hf_generate(
        model, padded, attention_mask=torch.tensor(mask), max_new_tokens=10,
        decoder_start_token_id=0,
    )[:, 1:]  # fmt: skip
    assert main([str(tmp_path / "t5"), "--prompts", str(tmp_path / "inputs.txt"),
                 "--max-new", "10", "--max-length", "11"]) == 0  # fmt: skip
    outputs = capsys.readouterr().out.removesuffix("\n").split("\n\n")  # a blank line between
    assert outputs == [tok.decode(w) for w in want]
