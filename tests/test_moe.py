"""The mixture of experts is exact and causal: changing tokens from position t on never
changes a logit before t, under every routing mode offered for decoders; KV-cache
decoding gives the full forward's logits; each routing equals a NumPy statement of it
token by token; and with `experts` split over a mesh axis the LM gives one device's
logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import namedmesh as nm
from lowering import Mesh, lower
from models import architecture as config
from models import transformer
from models.inference.decoding import Decoder
from models.layers import moe

CFG = config.Config(
    vocab=64, d_model=16, heads=2, d_kv=8, d_ff=24, layers=2, length=16, batch=2, experts=4
)
# capacity 0.5: a quarter of the choices fit (ceil(2 * 0.5 * 16 / 4) = 4 slots per expert
# of 32 choices a row), so capacity routing drops tokens wherever it routes
ROUTINGS = {
    "dropless": CFG,
    "capacity": CFG.replace(routing="capacity", capacity_factor=0.5),
}
MESH, EXPERTS_SPLIT = {"data": 2, "expert": 4}, "batch:data;experts:expert"
R = np.random.default_rng(0)
TOKENS = R.integers(0, CFG.vocab, size=(CFG.batch, CFG.length)).astype(np.int32)


@functools.cache
def model(routing: str):
    """(cfg, params with sharp gates, jitted logits of int tokens (batch, length))."""
    cfg = ROUTINGS[routing]
    params = transformer.init(transformer.lm_shapes(cfg), 1)
    gate = params["layers"]["ffn"]["gate"]
    params["layers"]["ffn"]["gate"] = gate * 4.0  # uneven routing: experts overflow
    logits = jax.jit(lambda p, t: lm_logits(p, t, cfg))
    return cfg, params, lambda t: np.asarray(logits(params, as_tokens(t)).data)


def as_tokens(t):
    return nm.tensor(t, ("batch", "length"))


def lm_logits(params, tokens, cfg):
    return transformer.lm_logits(params, tokens, cfg).transpose("batch", "length", "vocab")


@pytest.mark.parametrize("routing", ROUTINGS)
def test_later_tokens_never_change_earlier_logits(routing):
    _, _, logits = model(routing)
    base = logits(TOKENS)
    for t in (1, 6, 11):
        changed = TOKENS.copy()
        changed[:, t:] = (changed[:, t:] + 1 + np.arange(CFG.length - t)) % CFG.vocab
        got = logits(changed)
        np.testing.assert_array_equal(got[:, :t], base[:, :t], err_msg=f"{routing}, from {t}")
        assert not np.allclose(got[:, t:], base[:, t:])  # the change reached the router


@pytest.mark.parametrize("routing", ROUTINGS)
def test_kv_cache_decoding_equals_the_full_forward(routing):
    """A prefill of 5 tokens, then one cached step per token: each step's logits are the
    full forward's at its position (capacity routing: the cache keeps each position's
    choices, so a step queues behind the tokens before it; also with experts split)."""
    cfg, params, logits = model(routing)
    full = logits(TOKENS)
    decoders = [Decoder(params, cfg)]
    if routing == "capacity":  # its cache of choices, split by experts like the weights
        decoders.append(Decoder(params, cfg, mesh=Mesh(MESH), layout=EXPERTS_SPLIT))
    n = 5
    for dec in decoders:
        out, cache = dec.prefill_logits(TOKENS[:, :n], np.full(CFG.batch, n))
        np.testing.assert_allclose(np.asarray(out), full[:, n - 1], rtol=1e-5, atol=1e-5)
        for i in range(n, CFG.length):
            out, cache = dec.step_logits(TOKENS[:, i], i, cache)
            np.testing.assert_allclose(np.asarray(out), full[:, i], rtol=1e-5, atol=1e-5)


def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_dropless(x, p, k, router):
    """Each token's top-k experts of the router's softmax, every one computed: a gated
    SiLU FFN per chosen expert, weighted by the softmax over the chosen logits
    (topk_softmax) or by the full softmax's values there (softmax_topk)."""
    gate, wi, wg, wo = (np.asarray(p[n].data, np.float64) for n in ("gate", "wi", "wg", "wo"))
    out = np.zeros(x.shape)
    for b, t in np.ndindex(x.shape[:2]):
        logits = x[b, t] @ gate
        top = np.argsort(-logits, kind="stable")[:k]
        weights = np_softmax(logits[top]) if router == "topk_softmax" else np_softmax(logits)[top]
        for e, w in zip(top, weights, strict=True):
            a = x[b, t] @ wi[e]
            out[b, t] += w * ((a / (1 + np.exp(-a)) * (x[b, t] @ wg[e])) @ wo[e])
    return out


@pytest.mark.parametrize("router, k", [("topk_softmax", 2), ("softmax_topk", 3)])
def test_dropless_routing_equals_numpy_token_by_token(router, k):
    cfg = CFG.replace(ffn="gated_silu", router=router, experts_per_token=k)
    p = transformer.init(moe.moe_params(cfg), 2)
    x = R.normal(size=(cfg.batch, cfg.length, cfg.d_model)).astype(np.float32)
    x_dims = ("batch", "length", "d_model")
    run = jax.jit(lambda p, x: moe.moe(nm.tensor(x, x_dims), p, cfg, stats=True))
    out, stats, _ = run(p, x)
    np.testing.assert_allclose(np.asarray(out.data), np_dropless(x, p, k, router), atol=2e-5)
    assert float(stats["dropped"].data) == 0.0
    np.testing.assert_allclose(float(np.asarray(stats["load"].data).sum()), 1.0, rtol=1e-6)


def test_capacity_routing_drops_and_reports_it():
    """The capacity config drops choices (a quarter fit): the statistics say how many,
    against a count of the queues made here."""
    cfg = ROUTINGS["capacity"]
    _, params, _ = model("capacity")
    p = {
        k: nm.tensor(np.asarray(v.data)[0], v.dims[1:]) for k, v in params["layers"]["ffn"].items()
    }
    x = R.normal(size=(cfg.batch, cfg.length, cfg.d_model)).astype(np.float32)
    _, stats, _ = moe.moe(nm.tensor(x, ("batch", "length", "d_model")), p, cfg, stats=True)
    logits = x @ np.asarray(p["gate"].data)
    top = np.argsort(-logits, -1, kind="stable")[..., :2]
    c, kept = moe.capacity(cfg), 0
    for b in range(cfg.batch):
        counts = np.bincount(top[b].ravel(), minlength=cfg.experts)
        kept += np.minimum(counts, c).sum()
    want = 1 - kept / top.size
    assert want > 0.3
    np.testing.assert_allclose(float(stats["dropped"].data), want, rtol=1e-6)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_experts_split_over_a_mesh_axis_give_one_devices_logits(routing):
    """`experts:expert` keeps each device's expert weights; dropless routing's expert
    FFN (one grouped_ffn) psums (or psum_scatters) its rows over the experts' axis once,
    the bytes of the local result (the cost model's count)."""
    cfg, params, logits = model(routing)
    f = lower(lambda p, t: lm_logits(p, t, cfg), Mesh(MESH), EXPERTS_SPLIT)
    tokens = as_tokens(TOKENS)
    np.testing.assert_allclose(np.asarray(f(params, tokens).data), logits(TOKENS), atol=2e-5)
    if routing != "dropless":
        return
    steps = [s for s in _steps(f.plan(params, tokens)) if s.name == "grouped_ffn"]
    assert len({id(s.eqn) for s in steps}) == 1  # wi, relu and wo, in the layer scan's body
    for s in steps:
        (out,) = s.local[0].outs
        moved = [c for c in s.collectives if c.axes == ("expert",)]
        assert [c.kind for c in moved] == ["psum"]
        assert moved[0].nbytes == np.prod(out.shape) * 4  # (rows of one data shard)


def _steps(plan):
    for s in plan:
        yield s
        yield from _steps(s.body)


def test_grouped_matmul_equals_numpy_and_names_its_errors():
    x = R.normal(size=(3, 5, 6)).astype(np.float32)
    w = R.normal(size=(4, 6, 7)).astype(np.float32)
    g = R.integers(-1, 5, size=(3, 5, 2)).astype(np.int32)  # -1 and 4: outside, zero rows
    want = np.zeros((3, 5, 2, 7), np.float32)
    for i, j, c in np.ndindex(g.shape):
        if 0 <= g[i, j, c] < 4:
            want[i, j, c] = x[i, j] @ w[g[i, j, c]]
    args = (nm.tensor(x, "b l d"), nm.tensor(w, "e d f"), nm.tensor(g, "b l k"))
    np.testing.assert_allclose(nm.grouped_matmul(*args, dim="e").data, want, rtol=1e-5, atol=1e-5)
    jx = nm.tensor(jax.numpy.asarray(x), "b l d")  # the jax implementation: sorted rows
    got = nm.grouped_matmul(jx, *args[1:], dim="e")
    np.testing.assert_allclose(np.asarray(got.data), want, rtol=1e-5, atol=1e-5)
    few = nm.tensor(np.array([[[1, 4]]], np.int32), "b l k")  # 2 rows of 4 groups: by row
    got = nm.grouped_matmul(nm.tensor(jax.numpy.asarray(x[:1, :1]), "b l d"), args[1], few, "e")
    np.testing.assert_allclose(got.data[0, 0], [x[0, 0] @ w[1], np.zeros(7)], rtol=1e-5, atol=1e-5)
    for low in (jax.numpy.bfloat16, np.float16):  # NumPy has no einsum loop for these:
        lx, lw = x.astype(low), w.astype(low)  # summed in float32, rounded once, as einsum
        got = nm.grouped_matmul(nm.tensor(lx, "b l d"), nm.tensor(lw, "e d f"), args[2], dim="e")
        exact = np.einsum("bld,blkdf->blkf", lx.astype(np.float32), lw[g % 4].astype(np.float32))
        assert got.data.dtype == low
        np.testing.assert_array_equal(got.data, np.where(want != 0, exact, 0).astype(low))
    with pytest.raises(nm.ShapeError, match="groups must be integers"):
        nm.grouped_matmul(args[0], args[1], nm.tensor(g * 1.0, "b l k"), dim="e")
    with pytest.raises(nm.ShapeError, match="share no dim"):
        nm.grouped_matmul(nm.tensor(x, "b l q"), args[1], args[2], dim="e")


def test_training_reports_the_router_statistics(tmp_path):
    """A capacity-routed `moe` run (two microbatches a step) writes each step's router
    statistics to metrics.jsonl and TensorBoard: the experts' loads sum to 1 and choices
    are dropped (capacity 0.25 of an even share fits at most a quarter of them)."""
    import json

    from test_train_cli_flags import scalars

    from models.cli.train import main

    out = tmp_path / "run"
    flags = ["--config", "tiny", "--length", "16", "--batch", "4", "--quiet", "--model", "moe"]
    flags += ["--steps", "2", "--eval-batches", "1", "--set", "routing=capacity"]
    flags += ["--grad-accum", "2"]  # the statistics: the microbatches' weighted mean
    flags += ["--set", "capacity_factor=0.25", "--set", "layers=1", "--set", "d_model=16"]
    assert main([*flags, "--out", str(out), "--tensorboard", str(tmp_path / "tb")]) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        loads = [r[f"moe/load/{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0) and min(loads) >= 0
        assert 0.75 <= r["moe/dropped"] < 1 and r["moe/balance_loss"] > 0
    board = scalars(tmp_path / "tb")
    assert board["moe/dropped"] == pytest.approx({r["step"]: r["moe/dropped"] for r in records})


ROUTED = "batch:data;length:expert;experts:expert"  # rows split where the experts are


@functools.cache
def routed_layer():
    """(cfg, params with sharp gates, x, the MoE layer lowered under ROUTED)."""
    cfg = CFG.replace(ffn="gated_silu")
    p = transformer.init(moe.moe_params(cfg), 3)
    p["gate"] = p["gate"] * 4.0  # uneven routing: some device gets more than its share
    x = R.normal(size=(cfg.batch, cfg.length, cfg.d_model)).astype(np.float32)
    layer = lambda p, x: moe.moe(x, p, cfg)[:2]  # (out, the balancing loss)
    return cfg, p, nm.tensor(x, ("batch", "length", "d_model")), lower(layer, Mesh(MESH), ROUTED)


def test_expert_parallel_dropless_sends_rows_by_all_to_all_exactly():
    """Rows split over the experts' axis go to their experts' devices, through the whole
    expert FFN (wi, wg, silu, wo) there, and back, once: the layer equals NumPy token by
    token (every choice computed), its gradients (parameters' and input's) equal one
    device's, the compiled HLO holds the plan's collectives, bytes and all, and the
    training step compiles to 4 all-to-alls: the rows with their experts' ids packed
    beside them and the results forward, the transposes of both backward (3 grouped
    matmuls took 15; the ids apart, 5)."""
    from lowering.cost import expected_hlo
    from lowering.hlo import collectives

    cfg, p, x, f = routed_layer()
    want = np_dropless(np.asarray(x.data), p, cfg.experts_per_token, cfg.router)
    np.testing.assert_allclose(np.asarray(f(p, x)[0].data), want, atol=2e-5)
    plan = f.plan(p, x)
    (step,) = [s for s in plan if s.name == "grouped_ffn"]
    kinds = [c.kind for c in step.collectives if "expert" in c.axes]
    assert kinds == ["pmax"] + ["all_to_all"] * 2  # the busiest pair's count, one round
    hlo = f.compile(p, x).as_text()
    assert sorted(collectives(hlo)) == sorted(expected_hlo(plan, MESH))
    loss = lambda f: lambda p, x: (f(p, x).data ** 2).sum()  # noqa: E731
    grad = jax.jit(jax.grad(loss(lambda p, x: f(p, x)[0]), (0, 1))).lower(p, x).compile()
    assert [k for k, _, _ in collectives(grad.as_text())].count("all-to-all") == 4
    got = grad(p, x)
    one = jax.jit(jax.grad(loss(lambda p, x: moe.moe(x, p, cfg).out), (0, 1)))(p, x)
    for k in ("wi", "wg", "wo", "gate"):
        np.testing.assert_allclose(got[0][k].data, one[0][k].data, rtol=1e-4, atol=1e-4, err_msg=k)
    np.testing.assert_allclose(got[1].data, one[1].data, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_expert_ids_packed_beside_the_rows_come_back_exactly(dtype):
    """Group ids carried in lanes of the rows' dtype beside them (bfloat16 holds
    integers exactly only up to 256, float8 up to 16: as many lanes as the groups need)
    and the rows come back unchanged, the empty slots' -1 too."""
    from lowering.expert_routes import id_lanes, packed, unpacked

    groups = 70_000
    ids = np.array([-1, 0, 1, 15, 16, 255, 256, 257, 65_535, 65_536, groups - 1], np.int32)
    rows = jnp.asarray(R.normal(size=(len(ids), 3)), dtype)
    buffer = jax.jit(packed, static_argnums=2)(rows, ids, groups)
    lanes = {"float32": 1, "bfloat16": 3, "float8_e4m3fn": 5}[dtype]  # digits of 70,000
    assert id_lanes(dtype, groups) == lanes and id_lanes(dtype, 8) == 1
    assert buffer.shape == (len(ids), 3 + lanes) and buffer.dtype == rows.dtype
    got_rows, got_ids = jax.jit(unpacked, static_argnums=(1, 2))(buffer, 3, groups)
    np.testing.assert_array_equal(np.asarray(got_ids), ids)
    np.testing.assert_array_equal(np.asarray(got_rows, np.float32), np.asarray(rows, np.float32))


def test_expert_parallel_rows_all_to_one_expert_take_more_rounds_and_stay_exact():
    """Every row of every device chooses expert 0 (the worst load: one device receives
    all): the rounds repeat until all are done, and the result is NumPy's (bfloat16
    rows, each product summed in float32 and rounded once: the ids travel in two
    bfloat16 lanes beside them, the empty slots' -1 a NaN's bits)."""
    x = R.normal(size=(8, 4, 6)).astype(jnp.bfloat16)
    w = R.normal(size=(8, 6, 5)).astype(jnp.bfloat16)
    g = np.zeros((8, 4, 2), np.int32)
    g[0, 0, 1] = 7  # and one row to the last device
    f = lower(lambda x, w, g: nm.grouped_matmul(x, w, g), Mesh({"e": 8}), "b:e;experts:e")
    args = (nm.tensor(x, "b l d"), nm.tensor(w, "experts d f"), nm.tensor(g, "b l k"))
    wide = np.einsum("bld,blkdf->blkf", x.astype(np.float64), w[g].astype(np.float64))
    got = f(*args).data
    assert got.dtype == jnp.bfloat16
    want = wide.astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-6)
