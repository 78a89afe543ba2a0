"""`namedmesh export RUN --out DIR [--step N]`: a training run's checkpoint (the latest by
default) as a Hugging Face folder (config.json, model.safetensors, tokenizer.json) that
transformers loads.

A run fine-tuned from a Hugging Face folder (`train --init-from`) goes back out as its
base's family with the base's config.json, generation_config.json, tokenizer_config.json
and chat template, from the run's copy of them (RUN/base: the base folder is not read).
A run of the zoo's `lm` goes out as GPT-2, whose architecture it shares where its
config has layer norms, tanh-GELU, learned
positions, tied embeddings and d_kv * heads == d_model: its missing biases are zeros
and the tied softmax's d_model**-0.5 is folded into the final norm. Other models are
refused by name. A byte-tokenizer run writes no tokenizer.json (it has no `tokenizers`
form); `namedmesh eval` reads such a folder with the byte tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from models import cluster
from models.train import Parser, fail, user_errors

# Config field -> the value GPT-2's architecture has (an export as GPT-2 requires it)
GPT2_FIELDS = {
    "norm": "layer",
    "norm_position": "pre",
    "ffn": "gelu",
    "positions": "learned",
    "shared_embedding": True,
    "relative_bias": 0,
    "relative_buckets": 0,
    "experts": 0,
    "kv_heads": 0,
    "attention_scale": True,
    "encoder_layers": 0,
    "qkv_bias": False,
    "qk_norm": False,
    "sliding_window": 0,
    "attention_softcap": 0.0,
}


def arguments(argv=None, prog: str = "python -m models.export") -> argparse.Namespace:
    p = Parser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("run", help="a training run's --out folder")
    p.add_argument("--out", required=True, help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (the latest)")
    cluster.add_flags(p)
    return p.parse_args(argv)


def gpt2_config(cfg) -> dict:
    """config.json of GPT-2 for a zoo LM config (ExportError naming a field it lacks)."""
    from models.hub import UnsupportedModelError

    for field, value in GPT2_FIELDS.items():
        if getattr(cfg, field) != value:
            raise UnsupportedModelError(
                f"Config.{field}={getattr(cfg, field)!r}: GPT-2 has {value!r}; only an lm "
                "with GPT-2's architecture, or a run fine-tuned with --init-from, exports"
            )
    if cfg.heads * cfg.d_kv != cfg.d_model:
        raise UnsupportedModelError(
            f"heads {cfg.heads} x d_kv {cfg.d_kv} != d_model {cfg.d_model}: GPT-2 splits "
            "d_model into its heads"
        )
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab,
        "n_embd": cfg.d_model,
        "n_head": cfg.heads,
        "n_layer": cfg.layers,
        "n_inner": cfg.d_ff,
        "n_positions": cfg.learned_positions,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "tie_word_embeddings": True,
        **{k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")},
    }


def as_gpt2(params: dict, cfg):
    """(params, cfg) of GPT-2's form: zero biases where the zoo has none, and the tied
    logits' scale moved into the final norm (norm(x) * s, as GPT-2 has no scale)."""
    import numpy as np

    import namedmesh as nm
    from models import transformer

    cfg2 = cfg.replace(bias=True, scale_tied_logits=False)
    full = transformer.init(transformer.lm_shapes(cfg2), 0)

    def fill(ours, theirs):
        if isinstance(theirs, dict):
            return {k: fill(ours.get(k) if ours else None, v) for k, v in theirs.items()}
        return ours if ours is not None else nm.zeros_like(theirs)

    out = fill(params, full)
    s = np.float32(cfg.d_model**-0.5) if cfg.scale_tied_logits else np.float32(1)
    out["final_norm"] = {k: v * s for k, v in out["final_norm"].items()}
    return out, cfg2


def export(run: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run's checkpoint at `step` (the latest by default) to `out` as a
    Hugging Face folder."""
    from models import data, generate, hub

    run = Path(run)
    params, cfg, tokenizer = generate.load(run, step)  # refuses runs that are not decoder LMs
    if (run / "config.json").exists() and not (run / "run.json").exists():
        raise hub.HubError(f"{run} is a Hugging Face folder already; export reads a run")
    flags = json.loads((run / "run.json").read_text())
    base = generate.base_folder(run)  # a fine-tune's copy of its base's files
    if flags.get("init_from"):
        family, hf = hub.read_config(base or Path(flags["init_from"]))
    else:
        family, hf = "gpt2", gpt2_config(cfg)
        params, cfg = as_gpt2(params, cfg)
    tok = tokenizer.tok if isinstance(tokenizer, data.BPETokenizer) else None
    hub.save(hub.HubModel(family, cfg, params, tok, hf), out)
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):  # fmt: skip
        if base is not None and (base / name).exists():
            shutil.copyfile(base / name, Path(out) / name)
    return Path(out)


def main(argv=None, prog: str = "python -m models.export") -> int:
    args = arguments(argv, prog)
    try:  # one process's work: process 0 writes the folder alone, the others end at once
        if cluster.rank(args) != 0:
            return 0
    except cluster.ClusterError as e:
        return fail(e, 2, prog.removeprefix("python -m "))
    try:
        folder = export(args.run, args.out, args.step)
    except (*user_errors(), KeyError) as e:  # one line, never a traceback
        return fail(e, 2, prog.removeprefix("python -m "))
    print(f"wrote {folder}/config.json, model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
