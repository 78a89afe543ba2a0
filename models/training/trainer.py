"""Training on a mesh: the loss lowered under a layout, its gradient, an optax update.

The model is one lowered program (jit(shard_map)) over the mesh; `jax.grad` of it is
the distributed backward pass. The optimizer (elementwise over the parameter pytree)
runs in the same jit on the parameters as they are laid out, so its state takes their
layout too. Parameters and optimizer state are global values: a checkpoint restores
them onto any mesh and layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import namedmesh as nm
from lowering import Layout, Mesh, lower
from lowering.distributed import place
from lowering.layout import partition_spec
from models import transformer
from models.architecture import Config
from models.errors import DataError
from models.training import objectives, trainable
from models.training.optim import UNDECAYED, OptimizerSpec, decayed, optimizer  # noqa: F401 (their home was here)
from models.zoo import Model
from namedmesh.errors import ParameterError
from namedmesh.uneven import pad_stacks


def batch_tensors(batch: dict[str, np.ndarray]) -> dict[str, nm.Tensor]:
    return {k: nm.tensor(v, ("batch", "length")) for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """How a Trainer's step trains (the run's optimizer flags, --seed, --grad-accum,
    --freeze/--lora): `opt` the optax transformation (None: evaluation only), `seed` of
    the fresh parameters and of the per-step keys, `grad_accum` microbatches per step,
    `trained` a predicate on parameter paths (`layers/attn/q`; models/training/trainable.py):
    only those are differentiated and have optimizer state, the others stay as they are
    (frozen); None trains them all. `keyed`: the loss takes a random key each step even
    where cfg has no dropout (LoRA's adapters' own, models/layers/lora.py)."""

    opt: optax.GradientTransformation | None = None
    seed: int = 0
    grad_accum: int = 1
    trained: Callable[[str], bool] | None = None
    keyed: bool = False


class Trainer:
    """`state = init_state(seed)`; `state, loss = step(state, batch, step_number)`.

    With `grad_accum` N > 1 each step's batch is cut into N microbatches whose losses
    and gradients are summed, weighted by their target weights, in a loop inside the
    jitted step: the update of one batch N times a microbatch, the activation memory
    of one microbatch (a MoE's balancing loss is then the weighted mean of the
    microbatches' own). `spec` (TrainSpec) holds the optimizer, seed, grad_accum, the
    trained parameters and whether each step takes a key; None: TrainSpec(), evaluation
    only."""

    def __init__(
        self,
        model: Model,
        cfg: Config,
        mesh: Mesh,
        layout: Layout | str,
        spec: TrainSpec | None = None,
    ):
        spec = spec or TrainSpec()
        opt, seed, grad_accum = spec.opt, spec.seed, spec.grad_accum
        trained, keyed = spec.trained, spec.keyed
        if not isinstance(grad_accum, int) or grad_accum < 1 or cfg.batch % grad_accum:
            raise ParameterError(
                f"grad_accum {grad_accum!r} (--grad-accum) must be an int >= 1 that divides "
                f"the batch {cfg.batch} (--batch): each microbatch holds batch/grad_accum rows"
            )
        self.model, self.cfg, self.mesh, self.seed = model, cfg, mesh, seed
        self.grad_accum, self.trained = grad_accum, trained
        self.keyed = keyed or bool(cfg.dropout)  # a random key per step (dropout)
        self.layout = layout if isinstance(layout, Layout) else Layout(layout)
        self.shapes = model.shapes(cfg)
        self.opt = opt
        self.lowered = lower(lambda p, b, k: model.loss(p, b, cfg, k), mesh, self.layout)
        # the training step's program: the loss with the MoE router's statistics beside it
        self._with_stats = lower(
            lambda p, b, k: model.loss(p, b, cfg, k, stats=True), mesh, self.layout
        )
        self.stats = {}  # the last step's router statistics (jax arrays; {} without experts)
        self._step = None  # jitted at the first step, with the state's shardings pinned
        self._eval = jax.jit(lambda p, b: self.lowered(p, b, None).data)

    def init_state(self, params: dict | None = None) -> dict:
        """Parameters (`params`, or fresh ones from the seed) laid out on the mesh, and
        the optimizer's state for them."""
        if params is None:
            params = transformer.init(self.shapes, self.seed)
        params = place(self.padded(params), self.mesh, self.layout)
        if self.opt is None:  # evaluation only: `update` says so
            return {"params": params, "opt": None}
        train = trainable.split(params, self.trained)[0]  # frozen ones have no state
        # XLA gives zeros_like no input's sharding: without out_shardings every moment
        # would come out replicated, the whole model's optimizer state on each device
        shardings = _opt_state_shardings(jax.eval_shape(self.opt.init, train), train, self.mesh)
        opt_state = jax.jit(self.opt.init, out_shardings=shardings)(train)
        # Every leaf is put (committed) where it lies: on a one-device mesh jit's outputs are
        # uncommitted, and the step's committed outputs would compile the step a second time.
        opt_state = jax.tree_util.tree_map(jax.device_put, opt_state, shardings)
        return {"params": params, "opt": opt_state}

    def padded(self, params: dict) -> dict:
        """`params` with each layer stack that its pipeline stages do not divide padded
        to equal stages (a PaddedStack: namedmesh/uneven.py), so that each stage device
        holds only its layers and their optimizer state, and their gradients stay on it;
        chained stacks (a dense stack then MoE layers) by their chain's deal.
        A checkpoint stores the L-long view (models/training/checkpoint.py)."""
        sizes = self.lowered.stage_sizes
        stages = {d: sizes[d] for d in transformer.STACK_DIMS if d in sizes}
        return pad_stacks(params, stages, chain=transformer.CHAIN)

    def abstract_inputs(self):
        """Abstract params and (micro)batch: what `report` and `auto_layout` plan with."""
        rows = self.cfg.batch // self.grad_accum
        batch = objectives.abstract_batch(self.model.objective, rows, self.cfg.length)
        return transformer.abstract(self.shapes), batch

    def report(self):
        """The cost report of one training step: the loss and the gradients of the
        trained parameters (all, or the `trained` subtree: a LoRA step's frozen weights
        have no gradient and no optimizer state, lowering.train_step.optimizer_bytes),
        the stacks padded, as the trainer holds them."""
        params, batch = self.abstract_inputs()
        params = self.padded(params)
        if self.trained is None:
            return self.lowered.report(params, batch, self.key(1), wrt=0, show=False)
        train, frozen = trainable.split(params, self.trained)
        model, cfg = self.model, self.cfg
        loss = lambda t, f, b, k: model.loss(trainable.join(t, f), b, cfg, k)  # noqa: E731
        lowered = lower(loss, self.mesh, self.layout)
        return lowered.report(train, frozen, batch, self.key(1), wrt=0, show=False)

    def key(self, step: int):
        if not self.keyed:
            return None
        return nm.random.fold_in(nm.random.key(self.seed), step)

    def _value(self, params, batch, key):
        """(loss, router statistics) as jax arrays, for value_and_grad's has_aux."""
        loss, stats = self._with_stats(params, batch, key)
        return loss.data, {k: v.data for k, v in stats.items()}

    def _loss_and_grads(self, params, batch, key):
        """((loss, router statistics), gradients of the trained parameters)."""
        params, frozen = trainable.split(params, self.trained)
        value = lambda p, b, k: self._value(trainable.join(p, frozen), b, k)
        n = self.grad_accum
        if n == 1:
            return jax.value_and_grad(lambda p: value(p, batch, key), has_aux=True)(params)
        # row r of microbatch i is row r * n + i: each device's rows stay on it
        micro = {k: _rows_apart(t.data, n) for k, t in batch.items()}
        keys = None if key is None else [nm.random.fold_in(key, i).data for i in range(n)]
        total = jnp.maximum(batch["weights"].data.sum(), 1.0)

        def one(acc, xs):
            b, k = xs
            b = {name: nm.tensor(d, batch[name].dims) for name, d in b.items()}
            k = None if k is None else nm.tensor(k, key.dims)
            out, grads = jax.value_and_grad(lambda p: value(p, b, k), has_aux=True)(params)
            share = jnp.maximum(b["weights"].data.sum(), 1.0) / total
            add = lambda a, g: a + g * share
            return jax.tree_util.tree_map(add, acc, (out, grads)), None

        first = {name: nm.tensor(d[0], batch[name].dims) for name, d in micro.items()}
        first_key = None if key is None else nm.tensor(keys[0], key.dims)
        shape = jax.eval_shape(lambda p: value(p, first, first_key), params)
        zero = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), (shape, params))
        xs = (micro, None if keys is None else jnp.stack(keys))
        (loss, grads), _ = jax.lax.scan(one, zero, xs)
        return loss, grads

    def _apply(self, state, batch, key):
        (loss, stats), grads = self._loss_and_grads(state["params"], batch, key)
        params, frozen = trainable.split(state["params"], self.trained)
        updates, opt_state = self.opt.update(grads, state["opt"], params)
        params = trainable.join(optax.apply_updates(params, updates), frozen)
        new = {"params": params, "opt": opt_state}
        return new, loss, stats, grads

    def _update(self, state, batch, key):
        new, loss, stats, _ = self._apply(state, batch, key)
        return new, loss, stats

    def _guarded_update(self, state, batch, key):
        """The update, applied only when the loss, the gradients' global norm and the new
        parameters are finite; else the state stays as it was (the optimizer's too)."""
        new, loss, stats, grads = self._apply(state, batch, key)
        norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(norm) & all_finite(new["params"])
        kept = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, state)
        return kept, {"loss": loss, "grad_norm": norm, "finite": finite}, stats

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict:
        """The batch laid out on the mesh; DataError for a field missing or a token id
        outside the vocabulary (objectives.check_batch)."""
        objectives.check_batch(batch, self.model.objective, self.cfg.vocab)
        return place(batch_tensors(batch), self.mesh, self.layout)

    def local_rows(self, devices=None) -> np.ndarray | None:
        """The rows of a training batch that `devices` (this process's) hold under the
        layout: each process reads only its share of the data. None on one process."""
        if devices is None and jax.process_count() == 1:
            return None
        devices = set(jax.local_devices() if devices is None else devices)
        shape = (self.cfg.batch, self.cfg.length)
        lay = self.layout.of(("batch", "length"), shape, self.mesh, "the batch")
        sharding = jax.sharding.NamedSharding(self.mesh.jax_mesh, partition_spec(lay))
        held = [i[0] for d, i in sharding.devices_indices_map(shape).items() if d in devices]
        return np.unique(np.concatenate([np.arange(shape[0])[s] for s in held]))

    def update(self, state, batch: dict[str, np.ndarray], step: int):
        """(state, stats): one update with the batch of step `step` (numbered from 1);
        stats holds the step's loss, gradient norm and whether both (and the new
        parameters) are finite, as host numbers. A step that is not finite leaves the
        state as it was. The MoE router's statistics go to `self.stats`."""
        if self.opt is None:
            raise ParameterError(
                "Trainer.update: the TrainSpec has no optimizer (opt None: evaluation "
                "only); pass TrainSpec(opt=an optax transformation) to train"
            )
        placed = self.place_batch(batch)
        if len(batch["inputs"]) % self.grad_accum:
            raise DataError(
                f"the batch's {len(batch['inputs'])} rows: grad_accum {self.grad_accum} "
                "(--grad-accum) cuts them into microbatches of equal rows"
            )
        if self._step is None:  # a new state keeps the old one's layout: one compile
            shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)
            self._step = jax.jit(
                self._guarded_update, donate_argnums=(0,), out_shardings=(shardings, None, None)
            )
        state, out, self.stats = self._step(state, placed, self.key(step))
        out = jax.device_get(out)
        return state, {k: (bool(v) if k == "finite" else float(v)) for k, v in out.items()}

    def step(self, state, batch: dict[str, np.ndarray], step: int):
        """(state, loss): `update` without its other stats."""
        state, stats = self.update(state, batch, step)
        return state, stats["loss"]

    def router_metrics(self) -> dict[str, float]:
        """The last step's MoE router statistics as metrics ({} without experts):
        `moe/balance_loss` (summed over layers), `moe/dropped` (the share of choices
        capacity routing dropped), `moe/load/<e>` (expert e's share of the choices)."""
        if not self.stats:
            return {}
        out = {"moe/balance_loss": float(self.stats["balance"])}
        out["moe/dropped"] = float(self.stats["dropped"])
        load = np.asarray(self.stats["load"])
        return out | {f"moe/load/{e}": float(v) for e, v in enumerate(load)}

    def evaluate(self, state, batches) -> tuple[float, int]:
        """(mean loss in nats per token, tokens) over weighted positions of `batches`."""
        total, tokens = 0.0, 0
        for b in batches:
            n = int(b["weights"].sum())
            total += float(self._eval(state["params"], self.place_batch(b))) * n
            tokens += n
        return total / max(tokens, 1), tokens


def _opt_state_shardings(abstract_state, params, mesh: Mesh):
    """The shardings of an optimizer state (`abstract_state`, from `jax.eval_shape` of
    its init) for `params` laid out on `mesh`: a leaf that mirrors a parameter (its key
    path ends with the parameter's: AdamW's and Lion's moments, SGD's momentum) takes the
    parameter's sharding, of the same shape or, as Adafactor's factored second moments,
    with one of its dims left out; other leaves (step counts) are replicated."""
    everywhere = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec())
    keys = lambda path: tuple(jax.tree_util.keystr((k,)) for k in path)
    flat = [(keys(path), p) for path, p in jax.tree_util.tree_leaves_with_path(params)]
    flat.sort(key=lambda kp: -len(kp[0]))  # the longest matching path is the parameter

    def pick(path, leaf):
        path = keys(path)
        for name, p in flat:
            if path[len(path) - len(name) :] == name:
                return _mirrored(leaf.shape, p, everywhere)
        return everywhere

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def _mirrored(shape: tuple, param, everywhere):
    """The sharding of an optimizer leaf of `shape` that mirrors `param`: the parameter's
    own for its shape, its spec less the dim left out for a shape with one dim left out
    (replicated where which dim is ambiguous), else replicated."""
    sharding = param.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return everywhere
    if tuple(shape) == param.shape:
        return sharding
    spec = tuple(sharding.spec) + (None,) * (param.ndim - len(sharding.spec))
    kept = {
        spec[:i] + spec[i + 1 :]
        for i in range(param.ndim)
        if param.shape[:i] + param.shape[i + 1 :] == tuple(shape)
    }
    if len(kept) != 1:
        return everywhere
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept.pop()))


def all_finite(tree) -> jax.Array:
    """Whether every value of every array of `tree` is finite (a boolean scalar)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(tree)]))


def _rows_apart(x, n: int):
    """(n, rows / n, ...): microbatch i holds rows i, i + n, i + 2n, ... of x."""
    return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    return nats_per_token / math.log(2) / bytes_per_token
