"""Export and loading at their edges (cases outside the issues): a zoo LM exports as
GPT-2 only where transformers' GPT-2 computes its logits, and its adapters likewise;
weights files that contradict themselves are typed errors; PEFT's files name only the
modules adapted; float16 exports refuse weights float16 cannot hold. Oracles:
transformers' logits, PEFT's module matching and merge formula written in NumPy.

The runs here are made as training saves them (run.json, a byte tokenizer, a
checkpoint of initialised parameters), not trained: what export reads is the same."""

import json

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import namedmesh as nm  # noqa: E402
from models import zoo  # noqa: E402
from models.cli import export, generate  # noqa: E402
from models.io import hub, source  # noqa: E402
from models.layers import lora  # noqa: E402
from models.params import init  # noqa: E402
from models.training import checkpoint  # noqa: E402

IDS = np.arange(20).reshape(2, 10) * 7 % 256
TINY = ["d_model=32", "heads=4", "d_kv=8", "d_ff=64", "layers=2"]


def zoo_run(folder, sets=(), rank=None, targets="q,v", base=None):
    """A run saved at step 1 as training saves one: of the zoo's `lm` of config tiny
    (smaller by `TINY`, then `sets`) with initialised parameters, or fine-tuned from the
    Hugging Face folder `base` with its weights; with `rank`, a LoRA run of `targets`
    whose B adapters are random, not zero (alpha 16)."""
    family = hub.read_config(base)[0] if base else None
    flags = {"model": "lm", "config": family or "tiny", "family": family, "vocab": 256,
             "tokenizer": "byte", "batch": 2, "length": 16, "dtype": None,
             "set": [] if base else [*TINY, *sets], "init_from": base and str(base),
             "lora_rank": rank, "lora_alpha": 16.0 if rank else None, "lora_dropout": None,
             "lora_targets": targets if rank else None}  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(flags))
    (folder / "tokenizer.json").write_text(json.dumps({"kind": "byte"}))
    if base:
        hub.copy_base(base, folder / hub.BASE)
    cfg = source.run_config(folder, flags)
    shapes = lora.adapted(zoo.get("lm"), lora.of_flags(flags), cfg).shapes(cfg)
    shapes = jax.tree_util.tree_map(  # B drawn as A is, so the adapters matter
        lambda p: p._replace(init=0.1) if p.init == "zeros" else p,
        shapes,
        is_leaf=lambda p: hasattr(p, "sizes"),
    )
    params = lora.completed(hub.load(base).params, shapes, 0) if base else init(shapes, 0)
    saver = checkpoint.Checkpointer(folder)
    saver.save(1, {"params": params, "opt": (np.zeros(1, np.float32),)}, {})
    saver.close()
    return folder


def zoo_logits(run) -> np.ndarray:
    params, cfg, _ = generate.load(run)
    inputs = nm.tensor(IDS.astype(np.int32), ("batch", "length"))
    logits = hub.forward(params, {"inputs": inputs}, cfg, cfg.family or "gpt2")
    return np.asarray(logits.transpose("batch", "length", "vocab").data)


def hf_logits(folder) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.float().numpy()


# GPT-2's config.json has no way to say these: an export would drop them silently
NOT_GPT2 = {"embed_scale=true": "embed_scale", "attention_scale_dim=3.0": "attention_scale_dim"}


# options GPT-2 reads (norm_eps) or that a model without experts does not use
GPT2 = "norm_eps=0.001 capacity_factor=2.0 experts_per_token=1"


@pytest.mark.parametrize("sets", [GPT2, *NOT_GPT2])
def test_a_zoo_lm_exports_as_gpt2_only_with_gpt2s_logits(tmp_path, sets):
    """Exported, transformers' GPT-2 computes the run's logits; else refused by name."""
    run = zoo_run(tmp_path / "run", sets.split())
    try:
        export.export(run, tmp_path / "hf")
    except hub.UnsupportedModelError as e:
        assert sets in NOT_GPT2 and f"Config.{NOT_GPT2[sets]}=" in str(e)
        assert not (tmp_path / "hf").exists()
        return
    assert sets not in NOT_GPT2
    want = zoo_logits(run)
    np.testing.assert_allclose(hf_logits(tmp_path / "hf"), want, rtol=0, atol=1e-4)
    # the run ends no text at a token (generate's end ids), nor does transformers
    assert generate.end_ids(None, generate.load(run)[2], None, 256) == []
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert (hf.bos_token_id, hf.eos_token_id) == (None, None)


def test_adapters_of_a_zoo_lm_not_gpt2_are_refused_as_its_merged_export(tmp_path):
    """A zoo LoRA run of RMS norms: no GPT-2 module names for its adapters either."""
    from models.io.adapter_export import export_adapters

    run = zoo_run(tmp_path / "run", ["norm=rms"], rank=2)
    for call in (export.export, export_adapters):
        with pytest.raises(hub.UnsupportedModelError, match=r"Config\.norm='rms'"):
            call(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- Hugging Face folders -------------------------------------------------------------
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(a tiny random Llama of tied embeddings in shards listed by
    model.safetensors.index.json, its logits)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("llama") / "sharded"
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder, hf_logits(folder)


def loaded_logits(folder) -> np.ndarray:
    return np.asarray(hub.load(folder).logits(IDS).transpose("batch", "length", "vocab").data)


def copied(folder, to):
    import shutil

    return shutil.copytree(folder, to)


def test_an_index_naming_the_wrong_shard_is_a_damaged_file_naming_both(llama, tmp_path):
    folder = copied(llama[0], tmp_path / "f")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    where = index["weight_map"]
    other = sorted(set(where.values()) - {where["model.norm.weight"]})[0]
    where["model.norm.weight"] = other
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hub.DamagedFileError, match=rf"'model.norm.weight' to {other}, which"):
        hub.load(folder)


def test_a_folder_holding_model_safetensors_and_an_index_reads_as_transformers(llama, tmp_path):
    """transformers reads model.safetensors where both are there: so does hub.load
    (here a model.safetensors of other weights than the shards')."""
    from safetensors.numpy import load_file, save_file

    folder = copied(llama[0], tmp_path / "f")
    whole = {}
    for shard in folder.glob("model-*.safetensors"):
        whole |= {k: v[::-1].copy() for k, v in load_file(shard).items()}
    save_file(whole, folder / "model.safetensors", {"format": "pt"})
    want = hf_logits(folder)
    assert np.abs(want - llama[1]).max() > 1e-2  # transformers read the other weights
    np.testing.assert_allclose(loaded_logits(folder), want, rtol=0, atol=1e-4)


# --- export's dtype -----------------------------------------------------------------
def test_a_weight_float16_cannot_hold_is_refused_by_name_and_bfloat16_keeps_it(tmp_path, capsys):
    run = zoo_run(tmp_path / "run")
    params, _, _ = generate.load(run)
    embed = np.array(params["embed"].data)
    embed[3, 5] = 7e4  # past float16's 65504: it would be written as inf
    params["embed"] = nm.tensor(embed, params["embed"].dims)
    saver = checkpoint.Checkpointer(run)
    saver.save(2, {"params": params, "opt": (np.zeros(1, np.float32),)}, {})
    saver.close()
    out = tmp_path / "hf"
    assert export.main([str(run), "--out", str(out), "--dtype", "float16"]) == 2
    assert "tensor 'transformer.wte.weight' holds 70000" in capsys.readouterr().err
    assert not out.exists()
    export.export(run, out, dtype="bfloat16")
    from safetensors.torch import load_file

    kept = float(load_file(out / "model.safetensors")["transformer.wte.weight"][3, 5])
    assert abs(kept - 7e4) <= 7e4 * 2**-8  # within bfloat16's range: kept, rounded


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_models_weights_holding_its_head_read_as_transformers_reads_them(
    llama, tmp_path, same
):
    """lm_head.weight beside a tied embedding: equal to it, the tied model (transformers'
    logits); of other values (transformers unties them against config.json), refused."""
    from safetensors.numpy import load_file, save_file

    folder = copied(llama[0], tmp_path / "f")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.embed_tokens.weight"]
    held = load_file(shard)
    held["lm_head.weight"] = held["model.embed_tokens.weight"] * (1 if same else 2)
    save_file(held, shard, {"format": "pt"})
    index["weight_map"]["lm_head.weight"] = shard.name
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    want = hf_logits(folder)
    if same:
        np.testing.assert_allclose(loaded_logits(folder), want, rtol=0, atol=1e-4)
        return
    assert np.abs(want - llama[1]).max() > 1e-2  # transformers read another model
    with pytest.raises(hub.UnsupportedModelError, match="'lm_head.weight' of other values"):
        hub.load(folder)


@pytest.mark.parametrize("same", [True, False])
def test_a_gpt2_folder_holding_its_head_reads_it_as_transformers_does(tmp_path, same):
    """GPT-2 has no untied head: an lm_head.weight equal to wte is the tied model, one of
    other values (transformers reads it) is refused, where it was dropped silently."""
    from safetensors.numpy import load_file, save_file

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=4,
                                     n_positions=64)  # fmt: skip
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
    held = load_file(folder / "model.safetensors")
    wte = next(k for k in held if k.endswith("wte.weight"))
    held["lm_head.weight"] = held[wte] * (1 if same else 2)
    save_file(held, folder / "model.safetensors", {"format": "pt"})
    if same:
        np.testing.assert_allclose(loaded_logits(folder), hf_logits(folder), rtol=0, atol=1e-4)
        return
    with pytest.raises(hub.UnsupportedModelError, match="'lm_head.weight' of other values"):
        hub.load(folder)


# --- adapters in PEFT's files ---------------------------------------------------------
def peft_modules(model, targets) -> set[str]:
    """The modules PEFT adapts for `target_modules`: Linear (and GPT-2's Conv1D) layers
    named a target or ending in `.target` (peft.tuners.tuners_utils.check_target_module_exists)."""
    kinds = (torch.nn.Linear, transformers.pytorch_utils.Conv1D)
    return {
        name for name, m in model.named_modules()
        if isinstance(m, kinds) and any(name == t or name.endswith("." + t) for t in targets)
    }  # fmt: skip


def peft_value(pattern: dict, module: str, default):
    """rank_pattern's or alpha_pattern's value for a module, as PEFT looks it up."""
    import re

    keys = [k for k in pattern if re.match(rf"(.*\.)?{k}$", module)]
    return pattern[keys[0]] if keys else default


CASES = {  # a family whose rule is probed -> (its transformers class, config, targets)
    # a dense first layer, a stack of its own named model.layers.{i} as the MoE stack is
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        LLAMA, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        mlp_only_layers=[0]), "q,v,down"),
    # q, v fused in c_attn; attention's c_proj, not the MLP's of the same name
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32), "q,v,o"),
}  # fmt: skip


@pytest.mark.parametrize("family", CASES)
def test_adapter_files_name_the_adapted_modules_and_merge_as_the_merged_export(tmp_path, family):
    """PEFT's matching of target_modules finds the modules the file holds adapters of,
    no other; W + alpha/r B A of each (its rank_pattern, alpha_pattern) is the merged
    export's weight, and every other weight is the base's."""
    from safetensors.numpy import load_file

    from models.io.adapter_export import export_adapters

    cls, config, options, targets = CASES[family]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config)(**options)).eval()
    model.save_pretrained(tmp_path / "base")
    run = zoo_run(tmp_path / "run", rank=2, targets=targets, base=tmp_path / "base")
    flags = json.loads((run / "run.json").read_text())
    del flags["family"]  # as a run.json of old: the family is its base's
    (run / "run.json").write_text(json.dumps(flags))
    export.export(run, tmp_path / "merged")
    export_adapters(run, tmp_path / "adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    adapters = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    held = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            for k in adapters if k.endswith(".lora_A.weight")}  # fmt: skip
    assert peft_modules(model, conf["target_modules"]) == held
    base, merged = (load_file(tmp_path / f / "model.safetensors") for f in ("base", "merged"))
    for name, w in base.items():
        module = name.removesuffix(".weight")
        if module not in held:
            np.testing.assert_array_equal(merged[name], w)
            continue
        a = adapters[f"base_model.model.{module}.lora_A.weight"]
        b = adapters[f"base_model.model.{module}.lora_B.weight"]
        r = peft_value(conf["rank_pattern"], module, conf["r"])
        alpha = peft_value(conf["alpha_pattern"], module, conf["lora_alpha"])
        assert a.shape[0] == b.shape[1] == r
        update = alpha / r * b @ a
        want = w + (update.T if conf["fan_in_fan_out"] else update)
        np.testing.assert_allclose(merged[name], want, rtol=0, atol=1e-6)


# --- a run that saves while it is read ----------------------------------------------
def test_a_checkpoint_the_live_run_removes_while_it_is_read_reads_the_newest(tmp_path, monkeypatch):
    """The run keeps its newest 3 checkpoints: while export (any reader of the latest)
    reads the one it chose, the run saves three more and removes it. The read then takes
    the newest, never a half-read one or an error."""
    run = zoo_run(tmp_path / "run")
    params, _, _ = generate.load(run)
    negated = {**params, "final_norm": {k: -v for k, v in params["final_norm"].items()}}
    real = checkpoint.restore_params

    def saving_meanwhile(directory, target, step=None):
        if step == 1:  # the run goes on: steps 2 to 4, and step 1 goes (max_to_keep 3)
            saver = checkpoint.Checkpointer(run)
            for s in (2, 3, 4):
                state = {"params": negated, "opt": (np.zeros(1, np.float32),)}
                saver.save(s, state, {})
            saver.close()
            assert checkpoint.all_steps(run) == [4, 3, 2]
        return real(directory, target, step)

    monkeypatch.setattr(checkpoint, "restore_params", saving_meanwhile)
    got, _, _ = generate.load(run)
    want = negated["final_norm"]["scale"].data
    np.testing.assert_array_equal(np.asarray(got["final_norm"]["scale"].data), want)


def test_an_out_that_is_a_link_writes_the_folder_it_names_and_keeps_the_link(tmp_path):
    """The folder checked is the folder written: a link to an empty folder stays a link,
    now to the export, and nothing is left beside it."""
    run = zoo_run(tmp_path / "run")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    export.export(run, tmp_path / "link")
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "target" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run", "target"]


@pytest.mark.parametrize("name", ["base", "damaged"])
def test_an_out_that_is_a_runs_own_folder_not_made_yet_is_refused(tmp_path, name):
    """RUN/base of a run from scratch would make it a fine-tune of its export (another
    config, and the run could not be read again); RUN/damaged is where the run moves
    damaged checkpoints."""
    run = zoo_run(tmp_path / "run")
    with pytest.raises(export.DestinationError, match=rf"--out .*/run/{name}: is .*/run/{name},"):
        export.export(run, run / name)
    assert not (run / name).exists()


@pytest.mark.parametrize("rank", [None, 2])
def test_a_run_with_no_checkpoint_yet_is_one_line_saying_so(tmp_path, rank, capsys):
    """A run that has written its record and not yet a checkpoint, merged and adapters."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"model": "lm", "lora_rank": rank}))
    flags = ["--adapter-only"] if rank else []
    assert export.main([str(run), "--out", str(tmp_path / "hf"), *flags]) == 2
    assert "run: no checkpoint yet (a run saves one every --save-every" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_max_shard_size_with_adapter_only_is_refused_not_ignored(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export.arguments([str(tmp_path), "--out", "x", "--adapter-only", "--max-shard-size", "1KB"])
    assert e.value.code == 2 and "--max-shard-size with --adapter-only" in capsys.readouterr().err
