"""LoRA and frozen weights (models/layers/lora.py, models/training/trainable.py): a LoRA fine-tune
of a
tiny Llama folder trains its adapters alone (the base weights as the folder holds them,
optimizer state for the adapters only), starts equal to its base, lowers its loss, and
exports merged (transformers' logits equal the zoo's of the adapted model) or as PEFT's
adapter files, whose update B A, scaled, is what the merged export added; --freeze
leaves the weights it names as they were; bad flags are one line each."""

import contextlib
import io
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import namedmesh as nm  # noqa: E402
from models import catalog, zoo  # noqa: E402
from models.cli import export, generate  # noqa: E402
from models.cli.train import main as train  # noqa: E402
from models.io import hub  # noqa: E402
from models.layers import lora  # noqa: E402
from models.training import checkpoint, data, trainable  # noqa: E402

SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
RANK, ALPHA = 4, 16.0
TARGETS = "q,k,v,o,gate,up,down"
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IDS = np.arange(24).reshape(2, 12) * 7 % 200


def quiet(call, *args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = call(*args)
        except SystemExit as e:  # argparse's
            status = e.code
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama folder with a byte-level BPE tokenizer."""
    root = tmp_path_factory.mktemp("lora")
    tok = data.BPETokenizer.train(data.split(data.load_text())[0][:5_000], 200)
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM
    cls(cls.config_class(vocab_size=tok.vocab_size, **SIZES)).save_pretrained(root / "base")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok).save_pretrained(root / "base")
    return root / "base"


@pytest.fixture(scope="module")
def run(base):
    out = base.parent / "run"
    flags = ["--init-from", str(base), "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA),
             "--lora-targets", TARGETS, "--lora-dropout", "0.1", "--steps", "6", "--lr", "3e-2",
             "--schedule", "constant",
             "--freeze", "layers/ffn/wo_lora_*",
             "--length", "16", "--batch", "4", "--eval-batches", "1", "--quiet",
             "--out", str(out)]  # fmt: skip
    status, header, err = quiet(train, flags)
    assert status == 0, err
    return out, header


def adapter_count(frozen: bool = True) -> int:
    """r (in + out) per adapted module and layer, from the HF sizes (less down_proj's,
    which --freeze holds, unless `frozen`)."""
    d, f, h, kv = 32, 64, 4, 2
    k = d // h
    shapes = [(d, h * k), (d, kv * k), (d, kv * k), (h * k, d), (d, f), (d, f)]
    shapes += [(f, d)] if frozen else []
    return SIZES["num_hidden_layers"] * sum(RANK * (i + o) for i, o in shapes)


def test_the_header_counts_trainable_and_total_parameters(run, base):
    _, header = run
    hf = transformers.AutoModelForCausalLM.from_pretrained(base)
    total = sum(p.numel() for p in hf.parameters()) + adapter_count()
    assert f"{total:,} parameters, {adapter_count(frozen=False):,} trainable" in header


@pytest.fixture(scope="module")
def loaded(run, base):
    """The run's last parameters (adapters apart), config, LoRA, the folder's weights and
    those with the adapters a run of seed 0 starts from."""
    params, cfg, _ = generate.load(run[0], merge=False)
    spec = lora.of_flags(json.loads((run[0] / "run.json").read_text()))
    plain = hub.load(base).params
    shapes = lora.adapter_shapes(hub.shapes_of("llama", cfg), cfg, spec)
    return params, cfg, spec, plain, lora.completed(plain, shapes, seed=0)


@pytest.fixture(scope="module")
def merged(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "merged"
    assert export.main([str(run[0]), "--out", str(out)]) == 0
    return out


def test_only_adapters_not_frozen_train_and_hold_optimizer_state(run, loaded):
    folder, _ = run
    params, _, _, _, fresh = loaded
    start = dict(checkpoint.named(fresh))
    got = dict(checkpoint.named(params))
    assert set(got) == set(start)
    frozen = [p for p in got if not lora.is_adapter(p) or "wo_lora" in p]
    assert len(got) - len(frozen) == 2 * (len(MODULES) - 1)
    for path in got:  # the base weights and the frozen adapters are bit for bit as they were
        same = np.array_equal(np.asarray(got[path].data), np.asarray(start[path].data))
        assert same == (path in frozen), path
    leaves = checkpoint.read_meta(folder)["opt_leaves"]  # AdamW: two moments per adapter
    moments = sum(int(np.prod(shape)) for shape, _ in leaves if shape)
    assert moments == 2 * adapter_count(frozen=False)
    losses = [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").open()]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.05


def zoo_logits(params, cfg) -> np.ndarray:
    inputs = nm.tensor(IDS.astype(np.int32), ("batch", "length"))
    logits = hub.forward(params, {"inputs": inputs}, cfg, "llama")
    return np.asarray(logits.transpose("batch", "length", "vocab").data)


def test_adapters_start_at_the_base_and_export_merged_as_the_adapted_model(loaded, merged):
    params, cfg, spec, plain, fresh = loaded
    assert spec == lora.Lora(RANK, ALPHA, 0.1, tuple(TARGETS.split(",")))
    plain = zoo_logits(plain, cfg)
    np.testing.assert_array_equal(zoo_logits(lora.bind(fresh, spec), cfg), plain)  # B = 0
    back = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        got = back(torch.tensor(IDS)).logits.numpy()
    want = zoo_logits(lora.bind(params, spec), cfg)  # x W + s (x A) B, unmerged
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    assert np.abs(want - plain).max() > 1e-3


def test_adapter_only_export_is_peft_layout_whose_update_is_the_merged_one(
    run, base, merged, tmp_path
):
    from safetensors.numpy import load_file

    folder, _ = run
    assert export.main([str(folder), "--out", str(tmp_path / "a"), "--adapter-only"]) == 0
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == (
        "LORA", "CAUSAL_LM", RANK, ALPHA)  # fmt: skip
    assert conf["lora_dropout"] == 0.1 and sorted(conf["target_modules"]) == sorted(MODULES)
    assert conf["base_model_name_or_path"] == str(base.absolute())
    ada = load_file(tmp_path / "a" / "adapter_model.safetensors")
    merged, plain = (load_file(p / "model.safetensors") for p in (merged, base))
    names = set()
    for i in range(SIZES["num_hidden_layers"]):
        for m in MODULES:
            where = "self_attn" if m[0] in "qkvo" else "mlp"
            module = f"model.layers.{i}.{where}.{m}"
            a = ada[f"base_model.model.{module}.lora_A.weight"]
            b = ada[f"base_model.model.{module}.lora_B.weight"]
            w = plain[f"{module}.weight"]  # torch's Linear: (out, in)
            assert a.shape == (RANK, w.shape[1]) and b.shape == (w.shape[0], RANK)
            # PEFT's merge: W + lora_alpha / r * B @ A
            np.testing.assert_allclose(
                merged[f"{module}.weight"], w + ALPHA / RANK * b @ a, rtol=0, atol=1e-6
            )
            names |= {f"base_model.model.{module}.lora_{x}.weight" for x in "AB"}
    assert set(ada) == names
    try:
        import peft
    except ImportError:
        return
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base),
                                           tmp_path / "a").eval()  # fmt: skip
    with torch.no_grad():
        lora_logits = model(torch.tensor(IDS)).logits.numpy()
    back = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        np.testing.assert_allclose(lora_logits, back(torch.tensor(IDS)).logits.numpy(), atol=1e-4)


def test_gpt2s_fused_c_attn_exports_as_one_peft_module_whose_update_is_the_adapters(tmp_path):
    """q and v adapters of rank r are c_attn's one adapter of rank 2r (rank_pattern,
    alpha_pattern keep alpha/r): PEFT's merge of the file (W + alpha/r (B A)^T, Conv1D's
    fan_in_fan_out) gives transformers' GPT-2 the zoo's logits through the adapters."""
    from models.io.adapter_export import peft_adapters

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=200, n_positions=16)).eval()  # fmt: skip
    hf.save_pretrained(tmp_path)
    base = hub.load(tmp_path)
    spec = lora.Lora(RANK, ALPHA, 0.0, ("q", "v"))
    shapes = lora.adapter_shapes(hub.shapes_of("gpt2", base.config), base.config, spec)
    rng = np.random.default_rng(0)
    params = lora.completed(base.params, shapes, seed=0)
    for layer in (params["layers"]["attn"],):  # B is 0 at the start: draw it
        for k in [k for k in layer if k.endswith("_lora_b")]:
            layer[k] = nm.tensor(rng.normal(0, 0.3, layer[k].shape), layer[k].dims)
    rows = hub.tensors("gpt2", base.config, hub.FAMILIES["gpt2"].prefixes[0])
    tensors, fields = peft_adapters(params, rows, spec)
    r = 2 * RANK  # q's and v's
    wider = {"rank_pattern": {"c_attn": r}, "alpha_pattern": {"c_attn": 2 * ALPHA}}
    assert fields == {"target_modules": ["c_attn"], "fan_in_fan_out": True, **wider}
    ids = IDS % 200
    with torch.no_grad():
        plain = hf(torch.tensor(ids)).logits.numpy()
    state = hf.state_dict()
    for i in range(2):
        module = f"base_model.model.transformer.h.{i}.attn.c_attn"
        a, b = tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"]
        assert a.shape == (r, 32) and b.shape == (96, r)  # PEFT's Conv1D: (r, in), (out, r)
        assert not b[32:64].any()  # k's rows: no adapter
        w = state[f"transformer.h.{i}.attn.c_attn.weight"]
        w += torch.from_numpy((2 * ALPHA / r * b @ a).T.astype(np.float32))
    hf.load_state_dict(state)
    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(want - plain).max() > 1e-3  # the adapters matter
    bound = hub.HubModel("gpt2", base.config, lora.bind(params, spec), None, {})
    got = bound.logits(ids).transpose("batch", "length", "vocab").data
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_a_lora_steps_report_costs_the_adapters_gradients_and_optimizer_state_alone():
    """Trainer.report of a LoRA step: gradients and AdamW's moments of the trained
    subtree only, as optax's init of that subtree holds them (the frozen weights none)."""
    import jax
    import optax

    from lowering import Mesh
    from lowering.train_step import Training, optimizer_bytes
    from models.training.trainer import Trainer, TrainSpec

    cfg = catalog.get("tiny").replace(length=16, batch=2)
    model = lora.adapted(zoo.get("lm"), lora.Lora(RANK, ALPHA, 0.0, ("q", "v")), cfg)
    trained = trainable.chooser(trainable.paths(model.shapes(cfg)), (), lora.is_adapter)
    opt = optax.adamw(1e-3)
    tr = Trainer(model, cfg, Mesh({"data": 1}), "", TrainSpec(opt, trained=trained))
    rep = tr.report()
    train = trainable.split(tr.abstract_inputs()[0], trained)[0]
    moments = [x for x in jax.tree_util.tree_leaves(jax.eval_shape(opt.init, train)) if x.ndim]
    want = sum(x.size * x.dtype.itemsize for x in moments)  # mu and nu, not the count
    assert optimizer_bytes(rep, {"data": 1}, (), Training("adamw")) == want
    assert rep.memory_parts["gradients"] == want // 2  # one float32 per trained element


def test_freeze_patterns_are_globs_or_regular_expressions_on_paths():
    paths = trainable.paths(zoo.get("lm").shapes(catalog.get("tiny")))
    trained = trainable.chooser(paths, ["layers/attn/*", "emb.*"])
    frozen = {p for p in paths if not trained(p)}
    assert frozen == {p for p in paths if p.startswith("layers/attn/") or p == "embed"}
    assert trainable.chooser(paths) is None  # all train
    on, off = trainable.split(dict(a={"b": 1, "c": 2}, d=3), lambda p: p == "a/b")
    assert (on, off) == ({"a": {"b": 1}}, {"a": {"c": 2}, "d": 3})
    assert trainable.join(on, off) == dict(a={"b": 1, "c": 2}, d=3)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora-rank", "0"], "--lora-rank 0: must be >= 1 and <= 1000000000"),
        (["--lora-alpha", "4"], "--lora-alpha 4.0: a LoRA flag, with no --lora-rank"),
        (
            ["--lora-rank", "2", "--lora-targets", "q,query"],
            "--lora-targets q,query: unknown projection 'query'; the valid names are q, k, v, o, "
            "gate, up, down",
        ),  # fmt: skip
        (["--lora-rank", "2", "--lora-targets", "gate"], "the model has no gate projection"),
        (
            ["--model", "moe", "--lora-rank", "2", "--lora-targets", "q,down"],
            "the model has no down projection",
        ),  # fmt: skip
        (["--freeze", "layers/atn/*"], "--freeze layers/atn/*: matches no parameter"),
        (["--freeze", ".*"], "--freeze .*: leaves no parameter to train"),
    ],
)
def test_a_bad_lora_or_freeze_flag_is_one_line(flags, says, tmp_path):
    status, _, err = quiet(train, [*flags, "--steps", "1", "--quiet", "--out", str(tmp_path)])
    assert status == 2 and err.count("\n") == 1 and says in err, err


def test_adapter_dropout_zeroes_inputs_and_scales_the_rest_as_peft():
    """dropout(x) A B with A, B identities and x ones: each entry 0 or 1 / (1 - p), each
    layer's mask its own; without a key, x A B = x."""
    spec = lora.Lora(rank=8, alpha=8.0, dropout=0.5)
    eye = np.broadcast_to(np.eye(8, dtype=np.float32), (2, 8, 8))
    p = {"q": nm.zeros({"layers": 2, "d_model": 8, "d_out": 8}),
         "q_lora_a": nm.tensor(eye, ("layers", "d_model", "lora")),
         "q_lora_b": nm.tensor(eye, ("layers", "lora", "d_out"))}  # fmt: skip
    x = nm.ones({"batch": 4, "length": 8, "d_model": 8})

    def layer(tree, i):  # the update in layer i, as the layers' scan computes it
        one = {k: nm.isel(v, layers=i) for k, v in tree.items()}
        return np.asarray(lora.update(x, one, "q", ("batch", "length", "d_out")).data)

    got = [layer(lora.bind(p, spec, nm.random.key(0)), i) for i in (0, 1)]
    for g in got:
        assert set(np.unique(g)) == {0.0, 2.0} and 0.3 < (g == 0).mean() < 0.7
    assert not np.array_equal(got[0], got[1])
    assert np.array_equal(layer(lora.bind(p, spec), 0), np.ones((4, 8, 8)))


def test_eval_of_a_lora_run_scores_the_adapted_model_as_transformers_does(run, merged, tmp_path):
    """eval of the run (its adapters merged as it loads) against the mean NLL transformers
    gives the merged export over the same windows of 16 (the last one shorter)."""
    from models.cli import evaluate

    text = data.split(data.load_text())[1][:300]
    (tmp_path / "val.txt").write_text(text)
    ids = data.load_tokenizer(run[0]).encode(text)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    nll = []
    for start in range(0, len(ids) - 1, 16):
        window = torch.tensor(ids[start : start + 17], dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf(window[:, :-1]).logits[0].double(), -1)
        nll += (-logp[torch.arange(window.shape[1] - 1), window[0, 1:]]).tolist()
    args = [str(run[0]), "--data", str(tmp_path / "val.txt"), "--length", "16", "--quiet"]
    got = evaluate.evaluate(evaluate.arguments(args))
    assert got["tokens"] == len(nll) == len(ids) - 1
    np.testing.assert_allclose(got["loss"], np.mean(nll), rtol=1e-5)
