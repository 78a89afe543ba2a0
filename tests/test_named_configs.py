"""The newer families' named configs (each family module's NAMED: mistral-7b, qwen3-8b,
gemma-2-9b, ...): each is what the family makes of transformers' config of that
checkpoint, has as many parameters as transformers' model of it (built on the meta
device: no memory), is listed by `--config list`, and a large one is refused by the
memory check before it is built."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import catalog  # noqa: E402
from models.families import FAMILIES, NAMED  # noqa: E402
from models.io import hub  # noqa: E402
from models.layers.common import count  # noqa: E402

# The parameters each checkpoint's weights hold (its safetensors index / model card),
# written out here: the sizes in the family modules are the published ones.
PUBLISHED = {
    "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
    "phi-3-mini-4k": 3_821_079_552, "pythia-160m": 162_322_944, "opt-125m": 125_239_296,
    "gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984, "gemma-3-1b": 999_885_952, "roberta-base": 124_697_433,
    "distilbert-base-uncased": 66_985_530, "mixtral-8x7b": 46_702_792_704,
    "bert-base-uncased": 109_514_298,  # BertForMaskedLM: no pooler, the MLM head
    "qwen1.5-moe-a2.7b": 14_315_784_192, "qwen3-30b-a3b": 30_532_122_624,
    # the model card's 671B (multi-token prediction's 14B apart): transformers' 671_026_404_352
    # parameters and the 58 MoE layers' 256 e_score_correction_bias values (a saved buffer)
    "deepseek-v3": 671_026_419_200,
}  # fmt: skip


@pytest.mark.parametrize("name", list(NAMED))
def test_a_named_config_is_transformers_config_of_the_checkpoint(name):
    family, keys = NAMED[name]
    cls = getattr(transformers, FAMILIES[family].heads)
    hf = cls.config_class(**keys)  # transformers fills in every key the dict leaves out
    assert hf.model_type == family
    want = FAMILIES[family].config(hf.to_dict(), set())
    named = catalog.get(name)
    assert named == want.replace(batch=named.batch, family=family)  # hub records the family
    with torch.device("meta"):
        reference = cls(hf)
    saved = reference.state_dict(keep_vars=True)  # persistent buffers too (DeepSeek's bias)
    held = sum(p.numel() for p in reference.parameters())
    held += sum(b.numel() for n, b in reference.named_buffers() if n in saved)
    assert count(hub.shapes_of(family, named)) == held
    assert count(hub.shapes_of(family, named)) == PUBLISHED[name]


def test_config_list_shows_them_and_a_large_one_is_refused_before_it_is_built(
    tmp_path, capsys, monkeypatch
):
    import psutil

    from models.cli.train import main as train

    assert train(["--config", "list"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert set(NAMED) == set(PUBLISHED) and set(NAMED) <= set(rows)
    # mistral-7b: 32 layers of d_model 4096, 32 heads, d_ff 14336, 32000 tokens, 32768 positions
    assert rows["mistral-7b"] == ["32", "4096", "32", "14336", "32000", "32768"]
    memory = psutil.virtual_memory()._replace(available=2**30)  # 1 GiB free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    out = tmp_path / "o"
    flags = ["--config", "mistral-7b", "--length", "64", "--batch", "1", "--steps", "1"]
    assert train([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config mistral-7b needs an estimated" in err
    # adamw's state alone: 7.24e9 parameters x 3 (weights and two moments) x 4 bytes
    needs = float(err.split("needs an estimated ")[1].split()[0])
    assert needs > 7.2e9 * 12 / 2**30
    assert "the host has 1.0 GiB available" in err and not out.exists()


def test_an_unknown_name_is_a_config_error_whose_line_reads_as_written():
    """catalog.get's refusal is a ConfigError (and still a KeyError for callers that look
    names up); its message, as a command prints it, is not wrapped in a KeyError's quotes."""
    from models.architecture import ConfigError

    with pytest.raises(ConfigError) as caught:
        catalog.get("llama3-7b")
    assert isinstance(caught.value, KeyError)
    assert str(caught.value).startswith("unknown config 'llama3-7b'; known: ")
    assert "llama3-8b" in str(caught.value)
