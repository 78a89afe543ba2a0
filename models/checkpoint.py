"""Checkpoints with orbax: the training state's global values (not their layout), so a
checkpoint restores onto any mesh and layout, and a JSON record of the run.

The state is saved as its flat list of arrays; restoring needs a target state of the
same structure (a freshly initialised one), whose arrays' shardings say where the
restored values go. Saves are atomic: a run killed while saving leaves the previous
checkpoint as the latest."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """No checkpoint where one was expected, or one that does not fit the model."""


def _manager(directory, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute() / "checkpoints", options=options)


class Checkpointer:
    """Saves `(step, state, meta)` under `directory/checkpoints/<step>`."""

    def __init__(self, directory, max_to_keep: int = 3):
        self.manager = _manager(directory, max_to_keep)

    def save(self, step: int, state, meta: dict) -> None:
        leaves = jax.tree_util.tree_leaves(state)
        shapes = [[list(x.shape), str(x.dtype)] for x in leaves]
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(leaves)}),
                meta=ocp.args.JsonSave({**meta, "step": step, "leaves": shapes}),
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


def read_meta(directory, step: int | None = None) -> dict:
    """The JSON record of a checkpoint (the latest by default)."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    return mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def restore(directory, target, step: int | None = None):
    """(state, meta): the checkpoint's values in the structure and shardings of `target`."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    leaves, tree = jax.tree_util.tree_flatten(target)
    meta = read_meta(directory, step)
    want = [[list(x.shape), str(x.dtype)] for x in leaves]
    if meta["leaves"] != want:
        raise CheckpointError(
            f"the checkpoint at step {step} in {directory} holds {len(meta['leaves'])} arrays "
            f"that do not match this model's {len(want)} (another model or config?)"
        )
    abstract = {
        f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for i, x in enumerate(leaves)
    }
    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
        "state"
    ]
    return jax.tree_util.tree_unflatten(tree, [got[f"{i:05d}"] for i in range(len(leaves))]), meta
