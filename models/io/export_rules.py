"""What an export may write and what it writes as, apart from the command
(models/cli/export.py) so that the adapters' export (models/io/adapter_export.py), which the
command runs for --adapter-only, reads them without importing the command back (issue
42): the rules for `--out` (`check_destination`; an export's folder is marked by MARKER,
listing the files it wrote) and a zoo LM as GPT-2 (`gpt2_config`, `as_gpt2`).
models.cli.export re-exports them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from models.parts import Parts
from namedmesh.errors import NamedMeshError

MARKER = ".namedmesh-export"  # what an export writes into its folder: the files it wrote


class DestinationError(NamedMeshError, ValueError):
    """An `--out` that export must not replace: it holds the run, or files not its own."""


# Config field -> the value GPT-2's architecture has (an export as GPT-2 requires it)
GPT2_FIELDS = {
    "norm": "layer",
    "block": "pre",
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
    "parts": Parts(),  # no family's own parts (Gemma 2's soft-caps...)
}
# Config fields that do not change the logits a model computes from its weights: the
# sizes of a batch (max_positions: compared as learned_positions, the table's rows),
# training's dropout and balancing loss, the run's settings, the family's name
NOT_COMPUTED = ("length", "batch", "max_positions", "dropout", "moe_loss", "run", "family")
# and the options of what GPT2_FIELDS rules out (experts, rotary positions, T5's buckets)
NOT_COMPUTED += ("experts_per_token", "routing", "router", "expert_ff", "capacity_factor")
NOT_COMPUTED += ("rope", "relative_max_distance")


def gpt2_config(cfg) -> dict:
    """config.json of GPT-2 for a zoo LM config (ExportError naming a field it lacks)."""
    from models.io.hub import UnsupportedModelError

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
    hf = {
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
        # a zoo run ends no text at a token of its own; GPT2Config would give 50256
        "bos_token_id": None,
        "eos_token_id": None,
        **{k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")},
    }
    _check_reads_back(hf, cfg)
    return hf


def _check_reads_back(hf: dict, cfg) -> None:
    """UnsupportedModelError naming each field of `cfg` that the GPT-2 config.json `hf`,
    read back as models/families/gpt2.py reads it (as transformers does), does not
    give: an option the zoo computes that GPT-2 has not (embed_scale,
    attention_scale_dim...) would otherwise go out silently dropped. Biases and the
    tied logits' scale are what `as_gpt2` folds in."""
    from models.io.hub import UnsupportedModelError, family_config

    back = family_config("gpt2", hf, set())
    want = cfg.replace(bias=True, scale_tied_logits=False)
    differ = [
        f"{f.name}={getattr(want, f.name)!r} (GPT-2 reads {getattr(back, f.name)!r})"
        for f in dataclasses.fields(want)
        if f.name not in NOT_COMPUTED and getattr(back, f.name) != getattr(want, f.name)
    ]
    if back.learned_positions != want.learned_positions:
        differ.append(f"learned positions {want.learned_positions} ({back.learned_positions})")
    if differ:
        raise UnsupportedModelError(
            f"Config.{', '.join(differ)}: GPT-2's config.json cannot say so; only an lm "
            "with GPT-2's architecture, or a run fine-tuned with --init-from, exports"
        )


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


def check_destination(out: str | Path, run: str | Path) -> Path:
    """The folder to write for `out` (its links followed: the folder checked is the
    folder replaced, never the link itself); DestinationError unless it is a folder
    export may replace whole: none yet, an empty one, or an earlier export holding only
    what its marker lists."""
    out, run = Path(out), Path(run)
    where, held = out.resolve(), run.resolve()
    refuse = lambda why: DestinationError(
        f"--out {out}: {why}; export writes only into a new folder, an empty one, or an "
        f"earlier export (marked by {MARKER}): pass another --out"
    )
    if where.exists() and not where.is_dir():
        raise refuse("is a file, not a folder")
    if where == held or where in held.parents:
        raise refuse(f"holds the run {run} (its folder or one above it)")
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise refuse("is the current folder or one above it")
    if owner := _run_owning(where):  # its checkpoints/, damaged/ or base/: the run's own
        what = "is" if owner == where else "is inside"
        raise refuse(f"{what} {owner}, which the run there writes and reads")
    if not where.is_dir():
        return where
    ours = set(_marked(where)) | {MARKER} if (where / MARKER).is_file() else set()
    foreign = sorted(p.name for p in where.iterdir() if p.name not in ours)
    if foreign:
        many = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise refuse(f"holds {', '.join(foreign[:3])}{many}, not written by an export")
    return where


RUN_FOLDERS = ("checkpoints", "damaged", "base")  # what a run's folder holds of its own


def _run_owning(where: Path) -> Path | None:
    """The folder of a run's own (checkpoints/, damaged/, base/ beside a run.json)
    that `where` is, or is inside: a folder there named like a step would be read as a
    checkpoint, and the run's next save or resume would take or move it; RUN/base
    itself, not there yet in a run from scratch, would make the run a fine-tune of
    the export."""
    for folder in (where, *where.parents):
        if folder.name in RUN_FOLDERS and (folder.parent / "run.json").is_file():
            return folder
    return None


def _marked(folder: Path) -> list[str]:
    """The files an earlier export's marker lists ([] for a damaged marker)."""
    try:
        names = json.loads((folder / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):  # not JSON, or JSON of another shape
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
