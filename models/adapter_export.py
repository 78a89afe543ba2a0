"""`export RUN --adapter-only --out DIR`: a LoRA run's adapters alone, in PEFT's layout.

adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
target_modules by the Hugging Face module names, base_model_name_or_path: the run's
--init-from) and adapter_model.safetensors, whose tensors are named and shaped as PEFT's
`save_pretrained` writes them: `base_model.model.<the weight's module>.lora_A.weight`
of shape (r, in_features) and `...lora_B.weight` of shape (out_features, r), in
float32 (or export's --dtype). The module names come from the family's weight table
(models/hub.py), so a Llama run's q adapter of layer 0 is
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. A weight the family
stores fused with others (GPT-2's c_attn holds q, k and v) has no module of its own
for PEFT to adapt: such an export is refused, naming it (export it merged).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from models import lora
from models.export_rules import MARKER, as_gpt2, check_destination
from models.lora import LoraError
from models.source import hub_base

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix to the model's names


def export_adapters(
    run: str | Path, out: str | Path, step: int | None = None, dtype: str = "float32"
) -> Path:
    """Write the adapters of the LoRA run `run` at `step` (the latest by default) to the
    folder `out` as PEFT does, in `dtype` (export's rules for `out`: models/export_rules.py)."""
    from models import checkpoint, files, generate, hub, shards

    run = Path(run)
    check_destination(out, run)
    if not (run / "run.json").exists():
        raise checkpoint.CheckpointError(f"--adapter-only: {run} holds no run (no run.json)")
    flags = files.read_json(run / "run.json", "the run's record")
    spec = lora.of_flags(flags)
    if spec is None:
        raise LoraError(f"--adapter-only: {run} is not a LoRA run (its run.json has no lora_rank)")
    params, cfg, _ = generate.load(run, step, merge=False)
    family = flags.get("family") or "gpt2"
    if hub_base(run) is None:  # a zoo lm goes out as GPT-2: its table's config
        cfg = as_gpt2(lora.merged(params, spec), cfg)[1]
    rows = hub.tensors(family, cfg, hub.FAMILIES[family].prefixes[0])
    tensors, modules, transposed = {}, set(), False
    for path, a, b in _adapter_pairs(params):
        t = rows[path]
        names, conv = _peft_tensors(t, np.asarray(jax.device_get(a.data)), a.dims,
                                    np.asarray(jax.device_get(b.data)), b.dims)  # fmt: skip
        tensors |= names
        transposed |= conv
        modules |= {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in names}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(modules),
        "base_model_name_or_path": flags.get("init_from"),
        "bias": "none",
        "fan_in_fan_out": transposed,  # GPT-2's Conv1D stores (in, out)
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }

    def write(folder: Path) -> None:
        from safetensors.numpy import save_file

        save_file(shards.cast(tensors, dtype), folder / WEIGHTS, {"format": "pt"})
        (folder / CONFIG).write_text(json.dumps(config, indent=2))
        names = sorted(p.name for p in folder.iterdir())
        (folder / MARKER).write_text(json.dumps({"run": str(run.resolve()), "files": names}))

    files.replace_folder(out, write)
    return Path(out)


def _adapter_pairs(params: dict, prefix: str = ""):
    """(weight path, A, B) of every adapted weight of a parameter tree."""
    for k in sorted(params):
        v, path = params[k], f"{prefix}/{k}" if prefix else k
        if isinstance(v, dict):
            yield from _adapter_pairs(v, path)
        elif k.endswith("_lora_a"):
            name = k.removesuffix("_lora_a")
            yield f"{prefix}/{name}" if prefix else name, v, params[name + "_lora_b"]


def _peft_tensors(t, a: np.ndarray, a_dims, b: np.ndarray, b_dims):
    """({PEFT name: array} of one weight's adapters for every index of its stack,
    whether the file stores the weight (in, out)); LoraError for a fused weight."""
    if t.entry.part or len(t.groups) != 2:
        raise LoraError(
            f"--adapter-only: {t.entry.name} holds this weight fused with others; PEFT adapts "
            "whole modules: export the run merged (without --adapter-only)"
        )
    ins = next(i for i, g in enumerate(t.groups) if g and set(g) <= set(a_dims))
    in_group, out_group = t.groups[ins], t.groups[1 - ins]
    stack = t.stack
    a = a.transpose([a_dims.index(d) for d in (*stack, "lora", *in_group)])
    b = b.transpose([b_dims.index(d) for d in (*stack, *out_group, "lora")])
    out = {}
    for ix in np.ndindex(*a.shape[: len(stack)]):
        module = PEFT_PREFIX + t.name(ix).removesuffix(".weight")
        rank = a.shape[len(stack)]
        out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[ix].reshape(rank, -1))
        out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[ix].reshape(-1, b.shape[-1]))
    return out, ins == 0
