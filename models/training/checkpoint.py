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
empty or partial step is a DamagedCheckpointError naming the step and the array. The
record itself is covered by its SHA-256, stored as an item of its own (`digest`), and
its structure is checked on read: a record damaged yet still JSON (a key or a dims name
with a flipped bit) is a DamagedCheckpointError too, never taken for another model's. A
state holding a non-finite value is never saved (NonFiniteError); `restore_newest`
falls back past damaged steps to the newest that verifies.

A save runs in the background; one that fails (a full disk) is a SaveFailedError at the
next `check` (each step: it does not wait for a save in progress), `save`, `wait` or
`close`, naming the step whose save failed; that step is not listed, the older ones
are kept."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import namedmesh as nm
from namedmesh.tensor import Tensor
from namedmesh.uneven import pad_like, unpad_stacks


class CheckpointError(ValueError):
    """No checkpoint where one was expected, or one that does not fit the model."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files cannot be read or whose arrays fail their checksums."""


class NonFiniteError(CheckpointError):
    """A state holding NaN or infinity, refused for saving (or found on restore)."""


class SaveFailedError(CheckpointError, OSError):
    """A checkpoint that could not be written (a full or read-only disk): that step is
    not saved; the checkpoints saved before it are intact."""


def _record_digest(record: dict) -> str:
    """The SHA-256 of a checkpoint's JSON record (its keys sorted): stored beside it."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


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


class _WholeArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's jax.Array handler, replica 0 writing each array whole."""

    def __init__(self):
        super().__init__(use_replica_parallel=False)


def _whole_replicas_on_one_process() -> None:
    """On one process, orbax's default (replica-parallel saving: each replica of a
    replicated array writes a slice of it) buys no parallel write, every replica being
    local, and compiles a jit(slice) per device and shape: 105 compiles, 17 of a tiny
    model's 19 s first save on 8 CPU devices. There replica 0 writes each array whole
    (the same files); across processes each process's replicas keep writing slices.
    Registered once (orbax's registry is global; it warns on each override)."""
    if jax.process_count() > 1 or isinstance(
        ocp.type_handlers.get_type_handler(jax.Array), _WholeArrayHandler
    ):
        return
    quiet = logging.getLogger("absl")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the override's warning would reach the CLI's stderr
    try:
        ocp.type_handlers.register_type_handler(jax.Array, _WholeArrayHandler(), override=True)
    finally:
        quiet.setLevel(level)


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
        self.directory, self.saving = Path(directory), None  # the step of the newest save

    def save(self, step: int, state, meta: dict) -> None:
        """Save `state` at `step` (in the background; `wait` for it); NonFiniteError,
        saving nothing, when an array of it holds NaN or infinity. Layer stacks padded
        for uneven pipeline stages are stored L long (namedmesh/uneven.py), so that any
        mesh and layout restores them."""
        state = unpad_stacks(state)
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
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(_arrays(state["params"])),
            opt=ocp.args.StandardSave({f"{i:05d}": x for i, x in enumerate(opt)}),
            meta=ocp.args.JsonSave(record),
            digest=ocp.args.JsonSave({"sha256": _record_digest(record)}),
        )
        self.wait()  # orbax waits for the previous save anyway: its failure is named first
        _whole_replicas_on_one_process()
        self._guard(lambda: self.manager.save(step, args=args), step)
        self.saving = step

    def check(self) -> None:
        """SaveFailedError if a background save has failed; cheap (it never waits for a
        save in progress), so a run calls it every step."""
        if self.saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the background save; SaveFailedError if it failed."""
        self._guard(self.manager.wait_until_finished, self.saving)

    def close(self) -> None:
        self.wait()
        self._guard(self.manager.close, self.saving)

    def _guard(self, call, step) -> None:
        """`call()`; what orbax raises for a write that failed, as a SaveFailedError."""
        try:
            call()
        except Exception as e:  # OSError, or what orbax or tensorstore wrap it in
            self.saving = None  # said once: the failed step is not listed any more
            if lost := _lost_peer(e):
                raise lost from None  # not the disk's fault: resume (75), not free space (74)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            steps = sorted(self.manager.all_steps(), reverse=True)
            kept = f"the newest checkpoint is step {steps[0]}" if steps else "no checkpoint kept"
            raise SaveFailedError(
                f"the checkpoint of step {step} could not be written in "
                f"{self.directory}/checkpoints ({first}); {kept}"
            ) from None


def _lost_peer(error: BaseException) -> BaseException | None:
    """The error of jax's runtime in `error` or what it was raised from, in a run of
    several processes: a save's collective or barrier that failed as a peer process
    went (gloo's "Connection reset by peer"), which the run reports as a lost peer."""
    if jax.process_count() == 1:
        return None
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, jax.errors.JaxRuntimeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


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
        if lost := _lost_peer(e):  # restore's barrier, a peer gone: the files are not at fault
            raise lost from None
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
        except Exception as e:  # the same many types as above
            if lost := _lost_peer(e):
                raise lost from None
            bad.append(f"{item}/{'/'.join(keys)}")
    return [] if len(bad) == len(jax.tree_util.tree_leaves(abstract)) else bad  # [] : all


def read_meta(directory, step: int | None = None) -> dict:
    """The JSON record of a checkpoint (the latest by default), checked against its
    digest (checkpoints written before digests: its structure alone)."""
    mngr = _manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}/checkpoints")
    meta = _read(mngr, directory, step, "meta", ocp.args.JsonRestore())
    damaged = lambda why: DamagedCheckpointError(
        f"the checkpoint at step {step} in {directory}/checkpoints is damaged: its "
        f"record (meta) {why}"
    )
    if not isinstance(meta, dict) or meta.get("step") != step:
        raise damaged("is not the one written with it")
    if (Path(directory) / "checkpoints" / str(step) / "digest").exists():
        digest = _read(mngr, directory, step, "digest", ocp.args.JsonRestore())
        if not isinstance(digest, dict) or digest.get("sha256") != _record_digest(meta):
            raise damaged("fails its SHA-256 (a flipped bit in it, or in the digest)")
    why = _record_fault(meta)
    if why:
        raise damaged(why)
    return meta


_PARAM_KEYS = {"dims": str, "shape": int}


def _record_fault(meta: dict) -> str | None:
    """What is wrong with the structure of a checkpoint's record, or None: each part a
    restore reads, of the type it is written with."""
    params, leaves = meta.get("params"), meta.get("opt_leaves")
    if params is None:  # the older positional format, refused by name (_check_params)
        return None
    if not isinstance(params, dict):
        return "has params that are not a mapping"
    for path, d in params.items():
        ok = isinstance(d, dict) and isinstance(d.get("dtype"), str)
        ok = ok and all(
            isinstance(d.get(k), list) and all(type(v) is t for v in d[k])
            for k, t in _PARAM_KEYS.items()
        )
        if not ok:
            return f"describes parameter {path!r} as {d!r}"[:200]
    if not (isinstance(leaves, list) and all(_leaf(x) for x in leaves)):
        return "has no list of the optimizer's arrays (opt_leaves)"
    sums = meta.get("checksums", {})  # absent: a checkpoint written before checksums
    if not isinstance(sums, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(type(w) is int for w in v)
        for v in sums.values()
    ):
        return "has checksums that are not pairs of integers"
    skipped = meta.get("skipped", 0)
    if type(skipped) is not int or skipped < 0:
        return f"has a count of skipped steps {skipped!r}"
    return None


def _leaf(x) -> bool:
    return (
        isinstance(x, list) and len(x) == 2 and isinstance(x[1], str)
        and isinstance(x[0], list) and all(type(v) is int for v in x[0])
    )  # fmt: skip


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
    ({"params", "opt"}); its padded layer stacks (namedmesh/uneven.py) are read L long and
    padded again."""
    like, target = target, unpad_stacks(target)
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
    return pad_like({"params": params, "opt": opt}, like), meta


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
    try:  # every process of a run moves it (before its own saves list the steps)
        os.rename(src, aside / f"{step}")
    except FileNotFoundError:  # another process of the run moved it first
        pass
    except OSError:  # an older damaged/<step> there, or another file system
        if src.exists():
            shutil.move(str(src), str(aside / f"{step}"))
