"""`export RUN --adapter-only --out DIR`: a LoRA run's adapters alone, in PEFT's layout.

adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
target_modules by the Hugging Face module names (as much of each module's path as
PEFT's matching needs to find it and no module not adapted: GPT-2's `attn.c_proj`, as
`c_proj` would match the MLP's too), base_model_name_or_path: the run's
--init-from) and adapter_model.safetensors, whose tensors are named and shaped as PEFT's
`save_pretrained` writes them: `base_model.model.<the weight's module>.lora_A.weight`
of shape (r, in_features) and `...lora_B.weight` of shape (out_features, r), in
float32 (or export's --dtype). The module names come from the family's weight table
(models/io/hub.py), so a Llama run's q adapter of layer 0 is
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`.

A weight the family stores fused with others (GPT-2's c_attn holds q, k and v; Phi-3's
qkv_proj; GPT-NeoX's query_key_value, per head) is one module to PEFT, with one A and
one B. The adapters of its n adapted parts, each of rank r, are that module's adapter of
rank n r exactly: A stacks the parts' A (n r, in), and B (out, n r) holds each part's B
in its own rows of the fused output and its own r columns, zero elsewhere (block
diagonal): B A is each part's update in its place. adapter_config.json gives the module
that rank in `rank_pattern` and alpha n times the run's in `alpha_pattern`, so that
alpha / r, the scale, is the run's. Parts fused along their input, or whose inputs
differ, would need one A per part: such an export is refused, naming the tensor (export
the run merged).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np

from models.io.export_rules import MARKER, as_gpt2, check_destination, gpt2_config
from models.io.source import hub_base, need_checkpoint
from models.layers import lora
from models.layers.lora import LoraError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM's prefix to the model's names


def export_adapters(
    run: str | Path, out: str | Path, step: int | None = None, dtype: str = "float32"
) -> Path:
    """Write the adapters of the LoRA run `run` at `step` (the latest by default) to the
    folder `out` as PEFT does, in `dtype` (export's rules for `out`: models/io/export_rules.py)."""
    from models.cli import generate
    from models.io import files, hub, shards
    from models.training import checkpoint

    run = Path(run)
    where = check_destination(out, run)
    if not (run / "run.json").exists():
        raise checkpoint.CheckpointError(f"--adapter-only: {run} holds no run (no run.json)")
    flags = files.read_json(run / "run.json", "the run's record")
    spec = lora.of_flags(flags)
    if spec is None:
        raise LoraError(f"--adapter-only: {run} is not a LoRA run (its run.json has no lora_rank)")
    need_checkpoint(run)
    params, cfg, _ = generate.load(run, step, merge=False)
    if (base := hub_base(run)) is not None:  # its base's family, as the merged export's
        family = hub.read_config(base)[0]  # (a run.json of old has no "family")
    else:  # a zoo lm goes out as GPT-2 (if it is GPT-2): its table's config
        family = "gpt2"
        gpt2_config(cfg)  # the merged export's refusal of any other architecture
        cfg = as_gpt2(lora.merged(params, spec), cfg)[1]
    rows = hub.tensors(family, cfg, hub.FAMILIES[family].prefixes[0])
    tensors, fields = peft_adapters(params, rows, spec)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        **fields,
        "base_model_name_or_path": flags.get("init_from"),
        "bias": "none",
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

    files.replace_folder(where, write)
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


def peft_adapters(params: dict, rows: dict, spec: lora.Lora) -> tuple[dict, dict]:
    """({PEFT tensor name: array} of every adapter in `params`, the adapter_config.json
    fields they set: target_modules, fan_in_fan_out, rank_pattern and alpha_pattern);
    `rows` is hub.tensors' table of the family (where each weight sits in the files)."""
    host = lambda t: np.asarray(jax.device_get(t.data))  # noqa: E731
    # a file tensor -> its adapted parts (FileTensor, A, A dims, B, B dims): by its name
    # and its stack's first layer, as two stacks (Qwen3-MoE's dense first layers and its
    # MoE ones) name their tensors alike, each from its own layer number
    fused = {}
    for path, a, b in _adapter_pairs(params):
        entry = rows[path].entry
        fused.setdefault((entry.name, entry.first), []).append(
            (rows[path], host(a), a.dims, host(b), b.dims)
        )
    tensors, adapted, transposed = {}, {}, False
    for parts in fused.values():
        names, conv = _peft_tensors(parts)
        tensors |= names
        transposed |= conv
        for k, v in names.items():
            if k.endswith(".lora_A.weight"):
                adapted[k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")] = v.shape[0]
    ranks = _module_keys(adapted, {n.rsplit(".", 1)[0] for t in rows.values() for n in t.names()})
    wider = {m: r for m, r in sorted(ranks.items()) if r != spec.rank}
    return tensors, {
        "target_modules": sorted(ranks),
        "fan_in_fan_out": transposed,  # GPT-2's Conv1D stores (in, out)
        "rank_pattern": wider,
        "alpha_pattern": {m: spec.alpha * r / spec.rank for m, r in wider.items()},
    }


def _module_keys(adapted: dict[str, int], modules: set[str]) -> dict[str, int]:
    """{key: rank}: for each adapted module (name -> its rank) the shortest dotted
    suffix of its name that PEFT's matching (a module named `key` or ending in
    `.key`, in target_modules, rank_pattern and alpha_pattern) finds only in adapted
    modules of its rank, among the family's `modules`: `c_proj` would adapt GPT-2's
    MLP c_proj beside attention's, so attention's is `attn.c_proj`."""
    out = {}
    for name, rank in adapted.items():
        words = name.split(".")
        for k in range(1, len(words) + 1):
            key = ".".join(words[-k:])
            found = {m for m in modules | set(adapted) if m == key or m.endswith("." + key)}
            if all(adapted.get(m) == rank for m in found):
                out[key] = rank
                break
    return out


def _peft_tensors(parts: list) -> tuple[dict, bool]:
    """({PEFT name: array} of one file tensor's adapters for every index of its stack,
    whether the file stores the weight (in, out)); the adapted `parts` of a fused tensor
    as one adapter of their ranks summed (the module docstring); LoraError where that
    cannot be."""
    t = parts[0][0]
    if len(t.groups) != 2:
        raise LoraError(f"--adapter-only: {t.entry.name} is not a matrix; export the run merged")
    ins = next(i for i, g in enumerate(t.groups) if g and set(g) <= set(parts[0][2]))
    stack = t.stack
    As, Bs = [], []
    for p, a, a_dims, b, b_dims in sorted(parts, key=lambda x: x[0].entry.part or ()):
        if p.entry.part and p.entry.part[0] == ins or p.groups[ins] != t.groups[ins]:
            raise LoraError(
                f"--adapter-only: {t.entry.name} fuses {p.entry.path} with others along its "
                "input: PEFT's one lora_A cannot hold each part's; export the run merged"
            )
        a = a.transpose([a_dims.index(d) for d in (*stack, "lora", *p.groups[ins])])
        b = b.transpose([b_dims.index(d) for d in (*stack, *_zoo(p.groups[1 - ins]), "lora")])
        As.append(a.reshape(*a.shape[: len(stack) + 1], -1))
        Bs.append((_rows_of(p, ins), b.reshape(*b.shape[: len(stack)], -1, b.shape[-1])))
    width = t.file_shape()[1 - ins]
    out = {}
    for ix in np.ndindex(*As[0].shape[: len(stack)]):
        module = PEFT_PREFIX + t.name(ix).removesuffix(".weight")
        a = np.concatenate([x[ix] for x in As])
        b = np.zeros((width, a.shape[0]), a.dtype)
        col = 0
        for (rows, src), part in Bs:
            r = part.shape[-1]
            b[rows, col : col + r] = part[ix][src]
            col += r
        out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a)
        out[f"{module}.lora_B.weight"] = b
    return out, ins == 0


def _rows_of(t, ins: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rows of the file tensor's output axis that zoo parameter `t` fills, the
    index of each in `t`'s output dims flattened in their group's order): every row
    for a tensor of its own, its part's rows (contiguous, or per head) for a fused one."""
    layer = t.dims[len(t.stack) :]
    outs = _zoo(t.groups[1 - ins])
    shape = [t.sizes[d] for d in outs]
    index = np.arange(1, math.prod(shape) + 1).reshape(shape)  # 0: another part's row
    value = np.zeros([t.sizes[d] for d in layer], np.int64)
    value = value + index.transpose(np.argsort([layer.index(d) for d in outs])).reshape(
        [t.sizes[d] if d in outs else 1 for d in layer]
    )
    found = {}
    t.write(value.reshape((1,) * len(t.stack) + value.shape), found)
    line = np.take(found[t.name((0,) * len(t.stack))], 0, axis=ins)
    rows = np.flatnonzero(line)
    return rows, line[rows] - 1


def _zoo(group: tuple[str, ...]) -> tuple[str, ...]:
    """A file axis' zoo dims, without the fused parts' `*`."""
    return tuple(d for d in group if d != "*")
