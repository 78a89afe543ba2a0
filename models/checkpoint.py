"""Checkpoints with orbax: the training state's global values (not their layout), so a
checkpoint restores onto any mesh and layout, and a JSON record of the run.

Parameters are stored by their path and name (`layers/attn/q`), and the JSON record
lists each one's dims, shape and dtype, so a reader sees what is stored and weights
load without the optimizer (`restore_params`). The optimizer's state is stored apart,
as its flat list of arrays. Restoring needs a target of the same structure (a freshly
initialised one), whose arrays' shardings say where the restored values go. Saves are
atomic: a run killed while saving leaves the previous checkpoint as the latest."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

import namedmesh as nm
from namedmesh.tensor import Tensor


class CheckpointError(ValueError):
    """No checkpoint where one was expected, or one that does not fit the model."""


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
        opt = jax.tree_util.tree_leaves(state["opt"])
        record = {
            **meta,
            "step": step,
            "params": describe(state["params"]),
            "opt_leaves": [[list(x.shape), str(x.dtype)] for x in opt],
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
    steps = sorted(_manager(directory).all_steps()) if latest_step(directory) else []
    if not steps:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    if step is not None and step not in steps:
        raise CheckpointError(f"--step {step}: {directory} has checkpoints at steps {steps}")
    return steps[-1] if step is None else step


def read_meta(directory, step: int | None = None) -> dict:
    """The JSON record of a checkpoint (the latest by default)."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


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
    got = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
    return _as_tensors(got["params"], target), meta


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
    got = mngr.restore(step, args=ocp.args.Composite(opt=ocp.args.StandardRestore(abstract)))
    opt = jax.tree_util.tree_unflatten(tree, [got["opt"][f"{i:05d}"] for i in range(len(leaves))])
    return {"params": params, "opt": opt}, meta
