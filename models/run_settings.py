"""A run's settings, apart from the architecture (issue 42): how a model is computed
and placed (compute dtype, rematerialisation, the layer loop, the attention kernel and
its block, the mesh and the layout), not what it computes. A checkpoint of one
architecture trains, evaluates and decodes under any of them.

`models.architecture.Config` holds one as its `run` and keeps these names readable and
replaceable on itself (`cfg.dtype`, `cfg.replace(dtype="bfloat16")`, `--set
attention_block=64`), where Config checks them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Run:
    """dtype: the compute dtype (float32 | bfloat16; parameters stay float32); remat:
    the layer scan's rematerialisation (none | full | dots); scan_layers: True keeps the
    layers one loop, False unrolls them in the compiled program (nm.scan's unroll:
    compiles longer and on XLA:CPU trains faster; MaxText's scan_layers), "auto" (the
    default) unrolls where that measured faster at about the loop's compile time
    (nm.scan's unroll="auto": no remat, a program within namedmesh.control.UNROLL_BUDGET);
    attention: a models.layers.kernels.KERNELS name
    (full | blockwise | ring | fused) or "auto" (the default: by length, kernels.choose);
    attention_block: keys per block of blockwise
    attention; mesh and layout: the paper's mesh shape and layout rules."""

    dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool | str = "auto"
    attention: str = "auto"
    attention_block: int = 128
    mesh: tuple[tuple[str, int], ...] = (("batch", 1),)
    layout: str = "batch:batch"


FIELDS = tuple(Run.__dataclass_fields__)  # the settings' names, as Config reads them
