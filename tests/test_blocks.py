"""Blocks built from parts (issue 42): the residual compositions against their formulas
in NumPy, a family's block named by Config.block (its norms' parameters as the
composition names them), the --set names Config.block replaced still read, and the run
settings are Config.run's, so a run recorded with either loads."""

import dataclasses
import json

import numpy as np
import pytest

from models import transformer
from models.architecture import Config, ConfigError, parse_overrides
from models.cli import generate, train
from models.residual import COMPOSITIONS, Sublayer
from models.run_settings import Run

RNG = np.random.default_rng(0)
H = RNG.normal(size=(3, 5))
SCALES = {name: RNG.normal(size=5) for name in ("a_norm", "a_post_norm", "b_norm", "b_post_norm")}


def np_norm(x, name):
    """A stand-in for the block's norm: RMS over the last axis times the named scale."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True)) * SCALES[name]


# two sublayers unlike each other, each dropout-free but marked (x 0.5) so that a
# composition that forgets to apply it fails
F = {"a": lambda x: np.tanh(x @ np.eye(5)[::-1]), "b": lambda x: x**2 - 1.0}
SUBS = [Sublayer(n, lambda x, n=n: (F[n](x), n.upper()), lambda y: 0.5 * y) for n in "ab"]


def expected(kind: str) -> np.ndarray:
    a, b, n, h = F["a"], F["b"], np_norm, H
    if kind == "pre":
        h = h + 0.5 * a(n(h, "a_norm"))
        return h + 0.5 * b(n(h, "b_norm"))
    if kind == "post":
        h = n(h + 0.5 * a(h), "a_norm")
        return n(h + 0.5 * b(h), "b_norm")
    if kind == "sandwich":
        h = h + 0.5 * n(a(n(h, "a_norm")), "a_post_norm")
        return h + 0.5 * n(b(n(h, "b_norm")), "b_post_norm")
    return h + 0.5 * a(n(h, "a_norm")) + 0.5 * b(n(h, "b_norm"))  # parallel


@pytest.mark.parametrize("kind", sorted(COMPOSITIONS))
def test_each_composition_is_its_formula(kind):
    out, extras = COMPOSITIONS[kind].apply(H, SUBS, np_norm)
    np.testing.assert_allclose(out, expected(kind), rtol=1e-12)
    assert extras == {"a": "A", "b": "B"}


def test_a_blocks_norms_are_the_ones_its_composition_names():
    names = lambda block: {k for k in transformer.layer_shapes(Config(block=block)) if "norm" in k}
    assert names("sandwich") == {"attn_norm", "attn_post_norm", "ffn_norm", "ffn_post_norm"}
    assert names("parallel") == names("post") == {"attn_norm", "ffn_norm"}
    assert "final_norm" not in transformer.embedding_shapes(Config(block="post"))
    assert "final_norm" in transformer.embedding_shapes(Config(block="parallel"))


def test_a_parallel_block_with_cross_attention_is_refused_naming_both():
    with pytest.raises(ConfigError, match="block='parallel' with encoder_layers=2"):
        Config(block="parallel", encoder_layers=2)


@pytest.mark.parametrize(
    "items, want",
    [
        (["norm_position=post"], {"block": "post"}),
        (["post_norms=true"], {"block": "sandwich"}),
        (["parallel_residual=True", "d_model=32"], {"block": "parallel", "d_model": 32}),
        (["norm_position=post", "post_norms=false"], {"block": "post"}),
    ],
)
def test_the_set_names_block_replaced_still_read(items, want):
    assert parse_overrides(items) == want


def test_a_bad_value_of_a_replaced_set_name_is_refused_naming_it():
    with pytest.raises(ConfigError, match="post_norms='maybe'.*block=sandwich"):
        parse_overrides(["post_norms=maybe"])
    with pytest.raises(ConfigError, match="block must be one of"):
        Config(**parse_overrides(["norm_position=middle"]))


def test_a_run_recorded_with_replaced_set_names_loads(tmp_path):
    """A run whose run.json records `--set post_norms=true` (as runs before Config.block
    did) and run settings that were Config fields (`--set remat=dots`, `scan_layers`,
    `attention_block`: now Config.run's) loads: its config is the sandwich with those
    settings, and its checkpoint restores into the sandwich's parameters (post norms
    included) by name."""
    out = tmp_path / "old"
    old = ["post_norms=true", "layers=1", "remat=dots", "scan_layers=false", "attention_block=4"]
    flags = ["--config", "tiny", "--length", "8", "--batch", "2", "--quiet", "--eval-batches",
             "1", "--steps", "1", *(x for item in old for x in ("--set", item))]  # fmt: skip
    assert train.main([*flags, "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())["set"] == old
    params, cfg, _ = generate.load(out)
    assert (cfg.block, cfg.layers) == ("sandwich", 1)
    assert cfg.run == Run(remat="dots", scan_layers=False, attention_block=4)
    assert (cfg.remat, cfg.scan_layers, cfg.attention_block) == ("dots", False, 4)
    post = params["layers"]["ffn_post_norm"]["scale"]
    assert post.dims == ("layers", "d_model") and np.isfinite(np.asarray(post.data)).all()


def test_run_settings_are_the_run_records_and_made_and_replaced_by_name():
    cfg = Config().replace(dtype="bfloat16", attention="blockwise", d_model=32)
    assert cfg.run == Run(dtype="bfloat16", attention="blockwise") and cfg.d_model == 32
    assert cfg.replace(run=Run(), remat="full").run == Run(remat="full")
    assert Config(dtype="bfloat16", layers=3).run == Run(dtype="bfloat16")  # made as before
    assert "dtype" not in {f.name for f in dataclasses.fields(Config)}
    with pytest.raises(ConfigError, match="Config.remat must be one of .*'some'"):
        Config().replace(remat="some")
    # the layer loop's setting: "auto" by default, a word or a flag from --set
    assert Run().scan_layers == "auto"
    for text, want in (("auto", "auto"), ("false", False), ("True", True)):
        assert parse_overrides([f"scan_layers={text}"]) == {"scan_layers": want}
    with pytest.raises(ConfigError, match="scan_layers must be True, False or 'auto', got 'al'"):
        Config().replace(**parse_overrides(["scan_layers=al"]))
