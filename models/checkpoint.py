"""Checkpoints with orbax: the training state's global values (not their layout), so a
checkpoint restores onto any mesh and layout, and a JSON record of the run.

Parameters are stored by their path and name (`layers/attn/q`), and the JSON record
lists each one's dims, shape and dtype, so a reader sees what is stored and weights
load without the optimizer (`restore_params`). The optimizer's state is stored apart,
as its flat list of arrays. Restoring needs a target of the same structure (a freshly
initialised one), whose arrays' shardings say where the restored values go. Saves are
atomic: a run killed while saving leaves the previous checkpoint as the latest.

Integrity: the record holds a checksum of every saved array (parameters and optimizer
state), computed on the devices over the global value (so any mesh and layout gives the
same sums), and restore recomputes it: a flipped bit, a truncated or zeroed file, an
empty or partial step is a DamagedCheckpointError naming the step and the array. A
state holding a non-finite value is never saved (NonFiniteError); `restore_newest`
falls back past damaged steps to the newest that verifies."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import namedmesh as nm
from namedmesh.tensor import Tensor


class CheckpointError(ValueError):
    """No checkpoint where one was expected, or one that does not fit the model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read or whose arrays fail their checksums."""


class NonFiniteError(CheckpointError):
    """A state holding NaN or infinity, refused for saving (or found on restore)."""


def _words(x):
    """x's bits as a flat uint32 vector (narrower types widened)."""
    width = np.dtype(x.dtype).itemsize * 8
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{width}")).reshape(-1).astype(jnp.uint32)


def _sums(x):
    """Two sums of x's bit words mod 2**32, the second weighted by odd numbers (1, 3, 5,
    ...): any one flipped bit changes it, and it does not depend on how x is split."""
    w = _words(x)
    odd = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1
    finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
    return jnp.stack([w.sum(dtype=jnp.uint32), (w * odd).sum(dtype=jnp.uint32)]), finite


_checksums = jax.jit(lambda arrays: jax.tree_util.tree_map(_sums, arrays))


def checksums(arrays: dict[str, jax.Array]) -> tuple[dict[str, list[int]], list[str]]:
    """(name -> its two checksums, names of the arrays holding a non-finite value)."""
    got = jax.device_get(_checksums(arrays))
    sums = {k: [int(v) for v in s] for k, (s, _) in got.items()}
    return sums, [k for k, (_, finite) in got.items() if not finite]


def _flat_state(state) -> dict[str, jax.Array]:
    """Every array of a state by name: `params/layers/attn/q`, `opt/00003`."""
    out = {f"params/{p}": t.data for p, t in named(state["params"])}
    for i, x in enumerate(jax.tree_util.tree_leaves(state["opt"])):
        out[f"opt/{i:05d}"] = x
    return out


def _manager(directory, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute() / "checkpoints", options=options)


def named(params: dict, prefix: str = ""):
    """(path, Tensor) for every parameter of a nested dict, paths like `layers/attn/q`."""
    for k in sorted(params):
        path = f"{prefix}/{k}" if prefix else k
        if isinstance(params[k], Tensor):
            yield path, params[k]
        else:
            yield from named(params[k], path)


def describe(params: dict) -> dict:
    """path -> {dims, shape, dtype} of every parameter: what a checkpoint records."""
    return {
        p: {"dims": list(t.dims), "shape": list(t.shape), "dtype": str(t.data.dtype)}
        for p, t in named(params)
    }


def _arrays(params: dict) -> dict:
    return jax.tree_util.tree_map(lambda t: t.data, params, is_leaf=lambda x: isinstance(x, Tensor))


class Checkpointer:
    """Saves `(step, state, meta)` under `directory/checkpoints/<step>`; `state` is
    {"params": nested dict of Tensors, "opt": the optimizer's state}."""

    def __init__(self, directory, max_to_keep: int = 3):
        self.manager = _manager(directory, max_to_keep)

    def save(self, step: int, state, meta: dict) -> None:
        """Save `state` at `step` (in the background; `wait` for it); NonFiniteError,
        saving nothing, when an array of it holds NaN or infinity."""
        opt = jax.tree_util.tree_leaves(state["opt"])
        sums, bad = checksums(_flat_state(state))
        if bad:
            raise NonFiniteError(
                f"refusing to save step {step}: {bad[0]} holds non-finite values "
                f"({len(bad)} array(s) in all)"
            )
        record = {
            **meta,
            "step": step,
            "params": describe(state["params"]),
            "opt_leaves": [[list(x.shape), str(x.dtype)] for x in opt],
            "checksums": sums,
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(_arrays(state["params"])),
                opt=ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(opt)}),
                meta=ocp.args.JsonSave(record),
            ),
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def latest_step(directory) -> int | None:
    if not (Path(directory) / "checkpoints").exists():
        return None
    return _manager(directory).latest_step()


def check_step(directory, step: int | None) -> int:
    """`step`, or the latest when None; CheckpointError naming the steps saved when the
    run has no checkpoint at `step`."""
    steps = sorted(all_steps(directory))
    if not steps:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    if step is not None and step not in steps:
        raise CheckpointError(f"--step {step}: {directory} has checkpoints at steps {steps}")
    return steps[-1] if step is None else step


def all_steps(directory) -> list[int]:
    """The steps checkpointed in `directory`, newest first."""
    if not (Path(directory) / "checkpoints").exists():
        return []
    return sorted(_manager(directory).all_steps(), reverse=True)


def _read(mngr, directory, step: int, item: str, args, abstract=None):
    """One item of a checkpoint; DamagedCheckpointError naming the step, the item and
    (for arrays, `abstract` their target) the arrays that cannot be read, when orbax
    (or tensorstore, or json underneath) cannot read it."""
    try:
        return mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
    except Exception as e:  # orbax and tensorstore raise many types for damaged files
        first = (str(e).strip().splitlines() or [""])[0].split(". See full")[0][:300]
        bad = _unreadable(directory, step, item, abstract) if abstract is not None else []
        many = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        what = f"array(s) {', '.join(bad[:3])}{many}" if bad else f"its {item}"
        raise DamagedCheckpointError(
            f"the checkpoint at step {step} in {directory}/checkpoints is damaged: "
            f"{what} cannot be read ({type(e).__name__}: {first})"
        ) from None


def _unreadable(directory, step: int, item: str, abstract: dict) -> list[str]:
    """The arrays of an item that cannot be read, each tried alone (orbax's partial
    restore, with a manager of its own: the failing one has its item's handler set)."""
    mngr, bad = _manager(directory), []
    for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        keys = [k.key for k in path]
        one = x
        for k in reversed(keys):
            one = {k: one}
        restore_args = jax.tree_util.tree_map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), one
        )
        try:
            mngr.restore(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeRestore(
                one, restore_args=restore_args, partial_restore=True)}))  # fmt: skip
        except Exception:  # the same many types as above
            bad.append(f"{item}/{'/'.join(keys)}")
    return [] if len(bad) == len(jax.tree_util.tree_leaves(abstract)) else bad  # [] : all


def read_meta(directory, step: int | None = None) -> dict:
    """The JSON record of a checkpoint (the latest by default)."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    meta = _read(mngr, directory, step, "meta", ocp.args.JsonRestore())
    if not isinstance(meta, dict) or meta.get("step") != step:
        raise DamagedCheckpointError(
            f"the checkpoint at step {step} in {directory}/checkpoints is damaged: its "
            "record (meta) is not the one written with it"
        )
    return meta


def _verify(meta: dict, arrays: dict[str, jax.Array], directory, step: int) -> None:
    """DamagedCheckpointError for the first array whose checksums are not the recorded
    ones, NonFiniteError for one holding NaN or infinity."""
    sums, bad = checksums(arrays)
    want = meta.get("checksums")  # absent: a checkpoint written before checksums
    for name in sorted(sums):
        if want is not None and want.get(name) != sums[name]:
            raise DamagedCheckpointError(
                f"the checkpoint at step {step} in {directory}/checkpoints is damaged: "
                f"array {name} fails its checksum (stored {want.get(name)}, read {sums[name]})"
            )
    if bad:
        raise NonFiniteError(
            f"the checkpoint at step {step} in {directory}/checkpoints holds non-finite "
            f"values in {bad[0]} ({len(bad)} array(s) in all)"
        )


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _check_params(meta: dict, params: dict, directory, step: int) -> None:
    if "params" not in meta:
        raise CheckpointError(
            f"the checkpoint at step {step} in {directory} is of the older positional format "
            "(parameters not stored by name); retrain, or restore it with the namedmesh "
            "version that wrote it"
        )
    stored, want = meta["params"], describe(params)
    for path in sorted(set(stored) | set(want)):
        if stored.get(path) != want.get(path):
            raise CheckpointError(
                f"parameter {path!r} in the checkpoint at step {step} in {directory} is "
                f"{stored.get(path, 'absent')}; this model's is {want.get(path, 'absent')} "
                "(another model or config?)"
            )


def restore_params(directory, target: dict, step: int | None = None):
    """(params, meta): the checkpoint's parameters alone (no optimizer state), by name,
    in the dims and shardings of `target` (a nested dict of Tensors)."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    meta = read_meta(directory, step)
    _check_params(meta, target, directory, step)
    abstract = jax.tree_util.tree_map(_abstract, _arrays(target))
    got = _read(mngr, directory, step, "params", ocp.args.StandardRestore(abstract), abstract)
    params = _as_tensors(got, target)
    _verify(meta, {f"params/{p}": t.data for p, t in named(params)}, directory, step)
    return params, meta


def _as_tensors(arrays: dict, target: dict) -> dict:
    return {
        k: nm.tensor(arrays[k], v.dims) if isinstance(v, Tensor) else _as_tensors(arrays[k], v)
        for k, v in target.items()
    }


def restore(directory, target, step: int | None = None):
    """(state, meta): the checkpoint's values in the structure and shardings of `target`
    ({"params", "opt"})."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    params, meta = restore_params(directory, target["params"], step)
    leaves, tree = jax.tree_util.tree_flatten(target["opt"])
    want = [[list(x.shape), str(x.dtype)] for x in leaves]
    if meta["opt_leaves"] != want:
        raise CheckpointError(
            f"the optimizer state at step {step} in {directory} holds {len(meta['opt_leaves'])} "
            f"arrays that do not match this run's {len(want)} (another optimizer?)"
        )
    abstract = {f"{i:05d}": _abstract(x) for i, x in enumerate(leaves)}
    got = _read(mngr, directory, step, "opt", ocp.args.StandardRestore(abstract), abstract)
    _verify(meta, {f"opt/{k}": v for k, v in got.items()}, directory, step)
    opt = jax.tree_util.tree_unflatten(tree, [got[f"{i:05d}"] for i in range(len(leaves))])
    return {"params": params, "opt": opt}, meta


def restore_newest(directory, target, say=print):
    """(state, meta) of the newest checkpoint that verifies. Damaged newer steps are
    moved to `directory/damaged/<step>` (kept for inspection, out of orbax's way) and
    `say` tells which; NonFiniteError when the newest readable one is not finite,
    naming the newest finite one; CheckpointError when none verifies."""
    steps = all_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    damaged = []
    for step in steps:
        try:
            state, meta = restore(directory, target, step)
        except DamagedCheckpointError as e:
            damaged.append(step)
            say(f"warning: {e}")
            continue
        except NonFiniteError as e:
            good = _newest_finite(directory, target, [s for s in steps if s < step])
            where = f"the newest finite one is step {good}: remove {directory}/checkpoints/"
            raise NonFiniteError(
                f"{e}; {where}{step} (and newer) to resume from it"
                if good is not None
                else f"{e}; no older checkpoint is finite"
            ) from None
        for bad in damaged:
            _set_aside(directory, bad)
        if damaged:
            say(f"resuming from step {step}, the newest checkpoint that verifies")
        return state, meta
    raise DamagedCheckpointError(
        f"no checkpoint in {directory}/checkpoints verifies (steps {steps} are all damaged)"
    )


def _newest_finite(directory, target, steps: list[int]) -> int | None:
    for step in steps:
        try:
            restore(directory, target, step)
            return step
        except CheckpointError:
            continue
    return None


def _set_aside(directory, step: int) -> None:
    """Move a damaged step out of the checkpoints folder: orbax would not save a step
    below it, and a later --resume would meet it again."""
    aside = Path(directory) / "damaged"
    aside.mkdir(exist_ok=True)
    src = Path(directory) / "checkpoints" / str(step)
    if src.exists():
        shutil.move(str(src), str(aside / f"{step}"))
