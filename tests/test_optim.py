"""The optimizer and schedule flags (models/training/optim.py): each schedule's learning rate per
step against its formula in NumPy, each optimizer's first updates against the same
algorithm written in NumPy (float64), a fine-tune's defaults, and one-line refusals."""

import math

import jax
import numpy as np
import pytest

from models.training.optim import OPTIMIZER_DEFAULTS, WSD_DECAY, OptimizerSpec, optimizer, schedule


def want_lr(name, lr, steps, warmup, end, i) -> float:
    """The learning rate of update i (from 0), from the schedules' definitions."""
    if i < warmup:
        return lr * i / warmup
    t = i - warmup
    n = max(steps, warmup + 1) - warmup
    if name == "cosine":
        return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * min(t, n) / n))
    if name == "linear":
        return lr + (end - lr) * min(t, n) / n
    if name == "constant":
        return lr
    decay = max(1, round(WSD_DECAY * n))
    into = t - (n - decay)
    return lr if into <= 0 else lr + (end - lr) * min(into, decay) / decay


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize("steps, warmup, min_lr", [(20, 0, 1e-4), (23, 5, None), (4, 9, 0.0)])
def test_each_schedule_is_its_formula_at_every_step(name, steps, warmup, min_lr):
    lr = 2e-3
    end = lr / 10 if min_lr is None else min_lr
    s = schedule(name, lr, steps, warmup, min_lr)
    got = [float(s(i)) for i in range(steps + 3)]
    want = [want_lr(name, lr, steps, warmup, end, i) for i in range(steps + 3)]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)


def numpy_steps(name, params, grads, lrs, wd, betas, eps, clip):
    """The parameters after each update, by the optimizers' papers, in float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        norm = math.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
        scale = min(1.0, clip / norm) if clip else 1.0
        for k in p:
            gk = g[k].astype(np.float64) * scale
            decay = 0.0 if k == "gate_bias" else wd
            if name == "adamw":
                b1, b2 = betas
                m[k] = b1 * m[k] + (1 - b1) * gk
                v2[k] = b2 * v2[k] + (1 - b2) * gk**2
                mh, vh = m[k] / (1 - b1**t), v2[k] / (1 - b2**t)
                p[k] = p[k] - lr * (mh / (np.sqrt(vh) + eps) + decay * p[k])
            elif name == "lion":
                b1, b2 = betas
                u = np.sign(b1 * m[k] + (1 - b1) * gk)
                m[k] = b2 * m[k] + (1 - b2) * gk
                p[k] = p[k] - lr * (u + decay * p[k])
            else:  # sgd: L2 decay into the gradient, then heavy-ball momentum
                gk = gk + decay * p[k]
                m[k] = betas[0] * m[k] + gk
                p[k] = p[k] - lr * m[k]
        out.append({k: v.copy() for k, v in p.items()})
    return out


CASES = [
    ("adamw", dict(), 1.0),
    ("adamw", dict(weight_decay=0.3, betas=(0.8, 0.95), eps=1e-3), 0.0),
    ("lion", dict(), 0.5),
    ("lion", dict(weight_decay=0.0, betas=(0.5, 0.9)), 0.0),
    ("sgd", dict(), 0.0),
    ("sgd", dict(weight_decay=0.1, betas=(0.9,)), 2.0),
]


@pytest.mark.parametrize("name, given, clip", CASES)
def test_each_optimizer_takes_the_steps_of_its_algorithm(name, given, clip):
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "gate_bias": np.ones(3, np.float32)}
    grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
             for _ in range(4)]  # fmt: skip
    opt, sched = optimizer(OptimizerSpec(name, 1e-2, 6, 2, clip, schedule_name="linear", **given))
    settings = {**OPTIMIZER_DEFAULTS[name], **given}
    lrs = [float(sched(i)) for i in range(4)]
    want = numpy_steps(name, params, grads, lrs, settings["weight_decay"], settings["betas"],
                       settings.get("eps", 0.0), clip)  # fmt: skip
    state, p = opt.init(params), params
    for g, w in zip(grads, want, strict=True):
        updates, state = opt.update(g, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
        for k in p:
            np.testing.assert_allclose(np.asarray(p[k]), w[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_adafactor_takes_the_decay_it_is_given_only_where_the_mask_allows():
    """Adafactor has no NumPy twin here: with weight decay d its update is optax's own
    plus -lr * d * p on the decayed parameters (and the choosing bias is never decayed)."""
    import optax

    params = {"w": np.full((4, 3), 2.0, np.float32), "gate_bias": np.ones(3, np.float32)}
    grads = jax.tree.map(lambda x: np.full_like(x, 0.5), params)
    plain, _ = optimizer(OptimizerSpec("adafactor", 1e-2, 6, 0, 0.0, schedule_name="constant"))
    decayed, _ = optimizer(OptimizerSpec("adafactor", 1e-2, 6, 0, 0.0, schedule_name="constant",
                           weight_decay=0.25))  # fmt: skip
    ref = optax.adafactor(1e-2)
    u0, _ = plain.update(grads, plain.init(params), params)
    u1, _ = decayed.update(grads, decayed.init(params), params)
    r, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(u0["w"], r["w"], rtol=1e-6)
    np.testing.assert_allclose(u1["w"], r["w"] - 1e-2 * 0.25 * 2.0, rtol=1e-5)
    np.testing.assert_allclose(u1["gate_bias"], r["gate_bias"], rtol=1e-6)


def test_a_fine_tune_defaults_to_a_fine_tunes_settings_and_flags_win():
    from models.cli.train_flags import FINETUNE, SCRATCH, arguments

    scratch = arguments([])
    assert {k: getattr(scratch, k) for k in SCRATCH} == SCRATCH
    assert scratch.min_lr is None and scratch.betas is None  # lr/10, the optimizer's own
    fine = arguments(["--init-from", "somewhere"])
    assert {k: getattr(fine, k) for k in FINETUNE} == FINETUNE and fine.betas == (0.9, 0.999)
    given = arguments(
        ["--init-from", "x", "--lr", "1e-3", "--schedule", "wsd", "--betas", "0.5,0.6"]
    )
    assert (given.lr, given.schedule, given.betas, given.warmup) == (1e-3, "wsd", (0.5, 0.6), 0)


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--betas", "0.9,1.0"], "--betas '0.9,1.0': expected one or two numbers 0 <= b < 1"),
        (["--betas", "0.9,0.9,0.9"], "--betas '0.9,0.9,0.9'"),
        (["--optimizer", "adafactor", "--betas", "0.9,0.99"], "adafactor takes no betas"),
        (["--optimizer", "sgd", "--betas", "0.9,0.99"], "sgd takes 1"),
        (["--optimizer", "lion", "--eps", "1e-6"], "--eps 1e-06: lion takes no eps"),
        (["--schedule", "exponential"], "--schedule: invalid choice: 'exponential'"),
        (["--optimizer", "rmsprop"], "--optimizer: invalid choice: 'rmsprop'"),
        (["--min-lr", "-1"], "--min-lr -1.0: must be >= 0"),
        (["--weight-decay", "nan"], "--weight-decay nan: must be >= 0"),
        (["--eps", "0"], "--eps 0.0: must be > 0"),
    ],
)
def test_a_bad_optimizer_flag_is_one_line_and_exit_2(flags, names, capsys):
    from models.cli.train import arguments

    with pytest.raises(SystemExit) as e:
        arguments(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and names in err, err
