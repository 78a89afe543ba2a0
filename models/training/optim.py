"""The optimizer and learning-rate schedule of a training run, all optax's own.

`schedule(...)` is the learning rate per update (counted from 0): a linear warmup from 0
to the peak over `warmup` updates, then

- cosine: cosine decay to `min_lr` at the last step (optax.warmup_cosine_decay_schedule);
- linear: linear decay to `min_lr` at the last step;
- constant: the peak to the end;
- wsd (warmup, stable, decay): the peak until the last WSD_DECAY share of the steps,
  then linear decay to `min_lr` (optax.join_schedules of the three).

`optimizer(OptimizerSpec(...))` is AdamW, Adafactor, Lion or SGD on that schedule, after
clipping the gradients to a global norm, its weight decay on the parameters `decay_mask`
chooses (DECAYS: the matrices by default, as Hugging Face's Trainer and nanoGPT decay:
not biases, norm scales nor other vectors). Settings left None take the optimizer's defaults
(OPTIMIZER_DEFAULTS); a setting the optimizer has no use for is refused (ValueError
naming the flag), never ignored.
"""

from __future__ import annotations

import dataclasses

SCHEDULES = ("cosine", "linear", "constant", "wsd")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
WSD_DECAY = 0.2  # wsd: the share of the steps, at the end, over which it decays

# Per optimizer: weight decay, betas, eps when not given. AdamW's betas are the zoo's
# (0.98, as T5 and many LMs train from scratch); Lion's decay is larger as its paper
# advises (its updates are signs, of magnitude lr); Adafactor is the paper's (no decay);
# SGD's one beta is its momentum.
OPTIMIZER_DEFAULTS = {
    "adamw": {"weight_decay": 0.01, "betas": (0.9, 0.98), "eps": 1e-8},
    "adafactor": {"weight_decay": 0.0},
    "lion": {"weight_decay": 0.1, "betas": (0.9, 0.99)},
    "sgd": {"weight_decay": 0.0, "betas": (0.0,)},
}
BETAS = {"adamw": 2, "lion": 2, "sgd": 1}  # how many betas each takes (Adafactor: none)

# Parameters no gradient reaches, which weight decay alone would move: a sigmoid router's
# choosing bias (DeepSeek-V3's e_score_correction_bias; transformers keeps it as a buffer)
UNDECAYED = frozenset({"gate_bias"})
# --decay: which parameters weight decay pulls toward 0. matrices (None, the default):
# those of 2 or more dims besides a stack's `layers` (Hugging Face's Trainer leaves out
# biases and norm weights, nanoGPT every parameter under 2 dims); all: every one (the
# rule before --decay: a run recorded without it resumes with it, models/training/run.py)
DECAYS = ("matrices", "all")
# models/transformer.py's STACK_DIMS (not imported: the flags are checked before jax
# loads), a stack's axis of layers, which is no dim of a matrix; and the top-level keys
# of its stacks (`stacked`), whose raw arrays (without dims) carry that axis first
STACK_DIMS = ("layers",)
STACKS = ("dense", "layers", "encoder")


def decayed(params):
    """The weight-decay mask of a (nested dict of) parameters: all but UNDECAYED."""
    if not isinstance(params, dict):
        return True
    return {k: k not in UNDECAYED and decayed(v) for k, v in params.items()}


def decay_mask(kind: str | None = None):
    """optax's weight-decay mask (a function of the parameters) of --decay `kind`
    (DECAYS; None: matrices); UNDECAYED parameters never."""
    if (kind or "matrices") == "all":
        return decayed
    return lambda params: _matrices(params, top=True)


def _matrices(tree, top: bool = False, stacked: bool = False):
    """Whether each parameter of `tree` has 2 or more dims besides a stack's layers: by
    its dims' names (a namedmesh Tensor's), else by its shape and where it lies."""
    if not isinstance(tree, dict):
        if (dims := getattr(tree, "dims", None)) is not None:
            return sum(d not in STACK_DIMS for d in dims) >= 2
        return len(getattr(tree, "shape", ())) - stacked >= 2
    return {k: k not in UNDECAYED and _matrices(v, stacked=stacked or (top and k in STACKS))
            for k, v in tree.items()}  # fmt: skip


def schedule(name: str, lr: float, steps: int, warmup: int, min_lr: float | None = None):
    """The learning rate of update i (from 0) as an optax schedule; `min_lr` None: lr/10."""
    import optax  # here, not above: the flags are checked (`settings`) before jax loads

    end = lr / 10 if min_lr is None else min_lr
    steps = max(steps, warmup + 1)
    rise = optax.linear_schedule(0.0, lr, warmup)
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=end)
    if name == "linear":
        fall = optax.linear_schedule(lr, end, steps - warmup)
        return optax.join_schedules([rise, fall], [warmup])
    if name == "constant":
        return optax.join_schedules([rise, optax.constant_schedule(lr)], [warmup])
    if name == "wsd":
        decay = max(1, round(WSD_DECAY * (steps - warmup)))
        stable = steps - warmup - decay
        fall = optax.linear_schedule(lr, end, decay)
        parts = [rise, optax.constant_schedule(lr), fall]
        return optax.join_schedules(parts, [warmup, warmup + stable])
    raise ValueError(f"--schedule {name}: must be one of {', '.join(SCHEDULES)}")


def warmup_note(steps: int, warmup: int, lr: float, name: str = "cosine") -> str | None:
    """The line that says a warmup of at least the run's steps (the default 50 of a
    shorter run): the learning rate never reaches its peak `lr` nor decays (schedule
    `name`); None when the warmup ends within the run."""
    if warmup < steps:
        return None
    top = lr * (steps - 1) / warmup  # the last step's: update steps - 1 of the warmup
    decay = "" if name == "constant" else f" nor its {name} decay"
    return (
        f"--warmup {warmup} is not shorter than --steps {steps}: the learning rate rises "
        f"from 0 to {top:.3g} at the last step, never to --lr {lr:g}{decay}; pass "
        f"--warmup under {steps} to reach it"
    )


def settings(name: str, weight_decay=None, betas=None, eps=None) -> dict:
    """The optimizer's weight decay, betas and eps: those given, else its defaults;
    ValueError naming the flag for one it does not take."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {name}: must be one of {', '.join(OPTIMIZERS)}")
    out = dict(OPTIMIZER_DEFAULTS[name])
    if betas is not None:
        want = BETAS.get(name, 0)
        if not want:
            raise ValueError(f"--betas {_text(betas)}: {name} takes no betas")
        if len(betas) != want:
            raise ValueError(f"--betas {_text(betas)}: {name} takes {want} (b1,b2 or momentum)")
        out["betas"] = tuple(betas)
    if eps is not None:
        if "eps" not in out:
            raise ValueError(f"--eps {eps}: {name} takes no eps")
        out["eps"] = eps
    if weight_decay is not None:
        out["weight_decay"] = weight_decay
    return out


def _text(betas) -> str:
    return ",".join(str(b) for b in betas)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as the run's flags give it: `name` (--optimizer) at peak `lr` on
    `schedule(schedule_name, lr, steps, warmup, min_lr)`, gradients clipped to global
    norm `clip` (0: no clipping); weight_decay, betas, eps None: the optimizer's
    defaults (OPTIMIZER_DEFAULTS); `decay` the parameters it decays (DECAYS; None:
    matrices)."""

    name: str
    lr: float
    steps: int
    warmup: int
    clip: float
    schedule_name: str = "cosine"
    min_lr: float | None = None
    weight_decay: float | None = None
    betas: tuple[float, ...] | None = None
    eps: float | None = None
    decay: str | None = None

    @classmethod
    def of_flags(cls, args) -> OptimizerSpec:
        """The spec of train's flags (--optimizer, --lr, --steps, --warmup, --clip,
        --schedule, --min-lr, --weight-decay, --betas, --eps, --decay)."""
        return cls(
            args.optimizer, args.lr, args.steps, args.warmup, args.clip,
            schedule_name=args.schedule, min_lr=args.min_lr, weight_decay=args.weight_decay,
            betas=args.betas, eps=args.eps, decay=getattr(args, "decay", None),
        )  # fmt: skip


def optimizer(spec: OptimizerSpec):
    """(optax transformation, schedule): `spec.name` on its schedule after clipping
    gradients to global norm `spec.clip` (0: no clipping); weight decay on the parameters
    `decay_mask(spec.decay)` chooses."""
    import optax

    name, clip = spec.name, spec.clip
    sched = schedule(spec.schedule_name, spec.lr, spec.steps, spec.warmup, spec.min_lr)
    s = settings(name, spec.weight_decay, spec.betas, spec.eps)
    wd = s["weight_decay"]
    if spec.decay not in (None, *DECAYS):
        raise ValueError(f"--decay {spec.decay}: must be one of {', '.join(DECAYS)}")
    decayed = decay_mask(spec.decay)
    if name == "adamw":
        b1, b2 = s["betas"]
        opt = optax.adamw(sched, b1=b1, b2=b2, eps=s["eps"], weight_decay=wd, mask=decayed)
    elif name == "lion":
        b1, b2 = s["betas"]
        opt = optax.lion(sched, b1=b1, b2=b2, weight_decay=wd, mask=decayed)
    elif name == "adafactor":
        # optax's rate is not scaled by the schedule: scaled here, as adamw's is (-lr wd p)
        rate = (lambda count: wd * sched(count)) if wd else None
        opt = optax.adafactor(sched, weight_decay_rate=rate, weight_decay_mask=decayed)
    else:  # sgd: decay added to the gradient (L2), then momentum
        (momentum,) = s["betas"]
        opt = optax.sgd(sched, momentum=momentum or None)
        if wd:
            opt = optax.chain(optax.add_decayed_weights(wd, decayed), opt)
    return (optax.chain(optax.clip_by_global_norm(clip), opt) if clip else opt), sched
