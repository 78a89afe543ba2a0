"""Processes of one run check, before anything compiles, that they were started alike:
each hashes its run's parts (flags, config, mesh, layout, input shapes, step) and the
hashes are gathered over all processes (`multihost_utils.process_allgather`, a program
of the same shape on every process whatever the parts, so it cannot hang on a mismatch
as the training step would). A part that differs is an AgreementError on every process,
naming the part and the processes."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from namedmesh.errors import NamedMeshError


class AgreementError(NamedMeshError, RuntimeError):
    """Processes of one run started with a different config, mesh, layout, input
    shapes or step."""


def digest(value) -> np.ndarray:
    """8 uint32 words of the SHA-256 of the value's JSON (other objects by repr)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint32)


def differing(hashes: np.ndarray, names: list[str]) -> dict[str, list[int]]:
    """part -> the processes whose hash of it is not process 0's, from the gathered
    (processes, parts, 8) hashes."""
    out = {}
    for j, name in enumerate(names):
        bad = [i for i in range(hashes.shape[0]) if (hashes[i, j] != hashes[0, j]).any()]
        if bad:
            out[name] = bad
    return out


def check(**parts) -> None:
    """AgreementError on every process unless every process gave equal `parts`."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(parts)
    mine = np.stack([digest(parts[k]) for k in names])
    hashes = np.asarray(multihost_utils.process_allgather(mine))
    bad = differing(hashes, names)
    if bad:
        said = "; ".join(f"{k} differs on process(es) {v}" for k, v in bad.items())
        raise AgreementError(
            f"process {jax.process_index()}: the run's processes were not started alike "
            f"(compared with process 0: {said}); start every process with the same flags"
        )
