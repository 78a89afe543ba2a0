"""The parts a Transformer block is built from, written only in the namedmesh language: the
common layers (norms, attention, the MLP, embeddings: common.py), blockwise and ring
attention (blockwise.py), the attention kernels by name, multi-head latent attention,
the mixture of experts, rotary embeddings and LoRA adapters.

`models.layers` was a module: it is `models.layers.common` now (issue 42), and its names
are read from there on first use, so that code written for it keeps working. Lazily:
this folder's modules load this file first, and must not load the old module's imports
with it."""

import importlib
import importlib.util


def __getattr__(name: str):
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # a module of this folder: the import system's
    return getattr(importlib.import_module("models.layers.common"), name)


def __dir__():
    return sorted(set(globals()) | set(dir(importlib.import_module("models.layers.common"))))
