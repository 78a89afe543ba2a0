"""A fine-tune is self-contained and goes back out: a 2-step `train --init-from` of a tiny
Llama folder (tokenizer.json, generation_config.json, a chat template) keeps its base's
config and tokenizer files in the run, records family and tokenizer, and once the base
folder is moved away still exports (any step) a folder whose transformers logits equal
the zoo's, and still decodes, on a mesh too, what transformers decodes."""

import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import namedmesh as nm  # noqa: E402
from models.cli import export, generate  # noqa: E402
from models.io import hub  # noqa: E402
from models.training import checkpoint, data  # noqa: E402

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"  # noqa: E501
IDS = np.arange(24).reshape(2, 12) * 7 % 200


def base_folder(root, cls, template=None, **config):
    """(root/base, its tokenizer): a tiny random transformers `cls` (a CausalLM; its
    `config` beside the tiny sizes) and a BPE tokenizer trained on the shipped corpus."""
    tok = data.BPETokenizer.train(data.split(data.load_text())[0][:30_000], 200)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    base = root / "base"
    cls(cls.config_class(vocab_size=tok.vocab_size, **sizes, **config)).save_pretrained(base)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok, chat_template=template)
    fast.save_pretrained(base)
    return base, tok


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from models.cli.train import main as train

    root = tmp_path_factory.mktemp("finetune")
    llama = transformers.LlamaForCausalLM
    base, tok = base_folder(root, llama, TEMPLATE, eos_token_id=[5, 9], bos_token_id=1)
    out = io.StringIO()
    flags = ["--init-from", str(base), "--steps", "2", "--length", "16", "--batch", "4",
             "--save-every", "1", "--eval-batches", "1", "--quiet", "--lr", "1e-4",
             "--out", str(root / "run")]  # fmt: skip
    with contextlib.redirect_stdout(out):
        assert train(flags) == 0
    shutil.move(base, root / "moved")  # the run must not need its base any more
    assert tok.vocab_size == 256  # the byte alphabet at least
    return root / "run", out.getvalue()


def test_the_run_records_its_family_and_tokenizer_and_keeps_the_base_files(run):
    folder, header = run
    flags = json.loads((folder / "run.json").read_text())
    assert (flags["family"], flags["config"], flags["model"]) == ("llama", "llama", "lm")
    assert flags["tokenizer"] == "tokenizer.json of --init-from"
    assert "model lm (llama)" in header and "tokenizer tokenizer.json of --init-from, 256" in header
    kept = {p.name for p in (folder / "base").iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= kept
    assert not any(name.endswith(".safetensors") for name in kept)


def zoo_logits(folder, step) -> np.ndarray:
    params, cfg, _ = generate.load(folder, step)
    inputs = nm.tensor(IDS.astype(np.int32), ("batch", "length"))
    logits = hub.forward(params, {"inputs": inputs}, cfg, "llama")
    return np.asarray(logits.transpose("batch", "length", "vocab").data)


def test_any_step_exports_a_folder_transformers_reads_with_equal_logits(run, tmp_path):
    folder, _ = run
    got = {}
    for step in (1, 2):
        assert (
            export.main([str(folder), "--out", str(tmp_path / f"s{step}"), "--step", str(step)])
            == 0
        )
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"s{step}").eval()
        with torch.no_grad():
            got[step] = back(torch.tensor(IDS)).logits.numpy()
        want = zoo_logits(folder, step)
        np.testing.assert_allclose(got[step], want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert np.abs(got[1] - got[2]).max() > 1e-3  # the steps differ: each is its own
    assert (tmp_path / "s2" / "chat_template.jinja").exists()
    assert json.loads((tmp_path / "s2" / "generation_config.json").read_text())["eos_token_id"] == [
        5,
        9,
    ]
    with pytest.raises(checkpoint.CheckpointError, match=r"--step 7: .* steps \[1, 2\]"):
        export.export(folder, tmp_path / "s7", 7)


def test_generate_on_a_mesh_decodes_as_transformers_and_stops_at_the_runs_eos(
    run, tmp_path, capsys
):
    """The exported folder in transformers' greedy generate and the run in `generate
    --mesh --layout`: the same text, ended by the second of the EOS ids of the run's copy
    of generation_config.json; --chat renders the kept template."""
    folder, _ = run
    export.export(folder, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = data.load_tokenizer(folder)
    prompt = "The assert"
    ids = torch.tensor([tok.encode(prompt).tolist()])
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])  # the fourth new token ends the text
    kept = folder / "base" / "generation_config.json"
    before = kept.read_text()
    kept.write_text(json.dumps({"eos_token_id": [5, eos]}))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[5, eos])
    new = want[0, ids.shape[1] :].tolist()
    new = new[: new.index(eos)]
    assert len(new) <= 3
    (tmp_path / "p.txt").write_text(prompt + "\n")
    flags = [str(folder), "--prompts", str(tmp_path / "p.txt"),
             "--max-new", "10", "--max-length", "32", "--mesh", "data=1,model=2",
             "--layout", "heads:model;d_ff:model"]  # fmt: skip
    capsys.readouterr()
    try:
        assert generate.main(flags) == 0
    finally:
        kept.write_text(before)
    assert capsys.readouterr().out.rstrip("\n") == prompt + tok.decode(new)
    chat = generate.encode_prompts(["Hi"], tok, generate.base_folder(folder), chat=True)[0]
    assert tok.decode(chat) == "[Hi]>"


def test_config_list_names_every_config_and_a_config_too_big_is_refused_first(
    tmp_path, capsys, monkeypatch
):
    """`--config list` prints each named config; a config whose estimate (the lowering
    report's peak plus adamw's moments) exceeds the memory available is refused in one
    line naming both, before any parameter exists (gpt2 was OOM-killed after 268 s)."""
    import psutil

    from models import catalog
    from models.cli.train import main as train

    assert train(["--config", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(catalog.configs())
    assert next(x for x in lines if x.startswith("gpt2 ")).split()[1:] == [
        "12", "768", "12", "3072", "50257", "1024",
    ]  # fmt: skip
    memory = psutil.virtual_memory()._replace(available=2**30)  # 1 GiB free
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    flags = ["--config", "base", "--batch", "64", "--steps", "1", "--out", str(tmp_path / "o")]
    assert train(flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config base needs an estimated" in err
    assert "the host has 1.0 GiB available" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("dtype, size", [("bfloat16", "20KB"), ("float16", None)])
def test_an_export_in_a_dtype_and_shards_loads_with_the_rounded_weights_logits(
    run, tmp_path, dtype, size
):
    """`export --dtype D --max-shard-size S`: every weight stored in D, in shards of at
    most S bytes each (as save_pretrained: a tensor larger than S alone) listed by the
    index; transformers' logits from it (upcast to float32) equal the zoo's from its
    weights rounded to D, and the dtype is in config.json."""
    import ml_dtypes
    from safetensors import safe_open

    folder, _ = run
    flags = [str(folder), "--out", str(tmp_path / "hf"), "--dtype", dtype]
    assert export.main(flags + (["--max-shard-size", size] if size else [])) == 0
    out = tmp_path / "hf"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    names = []
    for name in files:
        with safe_open(out / name, "flax" if dtype == "bfloat16" else "np") as f:
            arrays = [np.asarray(f.get_tensor(k)) for k in f.keys()]
            names += [(k, name) for k in f.keys()]
        assert all(a.dtype == kind for a in arrays)
        nbytes = sum(a.nbytes for a in arrays)
        assert len(arrays) == 1 or nbytes <= (20_000 if size else 5 * 10**9), (name, nbytes)
    if size:
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == dict(sorted(names))
    else:
        assert (
            files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
        )
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = back(torch.tensor(IDS)).logits.numpy()
    params, cfg, _ = generate.load(folder, 2)
    leaf = lambda x: isinstance(x, nm.Tensor)
    rounded = lambda t: nm.tensor(np.asarray(t.data).astype(kind).astype(np.float32), t.dims)
    params = jax.tree.map(rounded, params, is_leaf=leaf)
    inputs = nm.tensor(IDS.astype(np.int32), ("batch", "length"))
    want = hub.forward(params, {"inputs": inputs}, cfg, "llama")
    want = np.asarray(want.transpose("batch", "length", "vocab").data)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert np.abs(got - zoo_logits(folder, 2)).max() > 0  # rounded: not the float32 logits


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--dtype", "int8"], "--dtype: invalid choice: 'int8'"),
        (["--max-shard-size", "5XB"], "--max-shard-size: expected a size such as 5GB"),
        (["--max-shard-size", "0"], "--max-shard-size: must be at least 1 byte"),
    ],
)
def test_a_bad_export_dtype_or_shard_size_is_one_line(tmp_path, flags, names, capsys):
    with pytest.raises(SystemExit) as e:
        export.main([str(tmp_path), "--out", str(tmp_path / "hf"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and names in err, err


def test_config_file_of_a_fine_tunes_run_json_repeats_it(run, tmp_path, capsys):
    """`train --config-file RUN/run.json` repeats a fine-tune (its base back in place):
    the same losses; a --tokenizer beside it is taken when it is the folder's own
    vocabulary, refused when another; --set of the architecture is refused by name."""
    from models.cli.train import main as train

    folder, _ = run
    root = folder.parent
    stored = json.loads((folder / "run.json").read_text())
    base = root / "moved"
    shutil.copytree(base, stored["init_from"])
    try:
        again = tmp_path / "again"
        flags = ["--config-file", str(folder / "run.json"), "--out", str(again)]
        assert train([*flags, "--tokenizer", str(base / "tokenizer.json")]) == 0
        (tmp_path / "byte").mkdir()
        data.ByteTokenizer().save(tmp_path / "byte")
        for extra, says in [
            (["--tokenizer", str(tmp_path / "byte" / "tokenizer.json")], "is another vocabulary"),
            (["--tokenizer", "bpe"], "--tokenizer bpe: a fine-tune of --init-from"),
            (["--set", "d_model=128"], "--set d_model=128: d_model is the architecture of"),
        ]:
            capsys.readouterr()
            try:
                code = train([*flags[:-1], str(tmp_path / "x"), *extra])
            except SystemExit as e:
                code = e.code
            err = capsys.readouterr().err
            assert code == 2 and err.count("\n") == 1 and says in err, err
    finally:
        shutil.rmtree(stored["init_from"])
    losses = lambda f: [json.loads(x)["loss"] for x in (f / "metrics.jsonl").open()]
    assert losses(again) == losses(folder)
    assert json.loads((again / "run.json").read_text())["lr"] == 1e-4
