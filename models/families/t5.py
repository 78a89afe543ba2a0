"""T5 v1.0 and v1.1 (T5ForConditionalGeneration): an encoder-decoder with RMSNorm,
unscaled attention logits, log-bucketed relative position biases (one table per stack,
in layer 0), ReLU or gated-GELU FFNs, tied (v1.0, logits scaled by d_model**-0.5) or
untied (v1.1) embeddings."""

from __future__ import annotations

from models.architecture import Config
from models.families.common import Entry, Family, UnsupportedModelError, act_named, norm


def config(hf: dict, names: set[str]) -> Config:
    proj = hf.get("feed_forward_proj", "relu")
    gated = proj.startswith("gated-")
    act = act_named(proj.removeprefix("gated-"))
    act = "gelu" if proj == "gated-gelu" else act  # transformers' gated-gelu is gelu_new
    if act is None:
        raise UnsupportedModelError(f"config.json: feed_forward_proj={proj!r}")
    hf.get("dense_act_fn"), hf.get("is_gated_act")  # both derived from feed_forward_proj
    if hf.get("is_decoder", False):
        raise UnsupportedModelError("config.json: is_decoder=True (a T5 decoder alone)")
    tied = hf.get("tie_word_embeddings", True) is not False
    scale = hf.get("scale_decoder_outputs", tied)
    return Config(
        vocab=hf["vocab_size"], d_model=hf["d_model"], heads=hf["num_heads"], d_kv=hf["d_kv"],
        d_ff=hf["d_ff"], layers=hf.get("num_decoder_layers") or hf["num_layers"],
        encoder_layers=hf["num_layers"], length=hf.get("n_positions", 512),
        ffn=f"gated_{act}" if gated else act, norm="rms",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), attention_scale=False, positions="none",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        shared_embedding="lm_head.weight" not in names, scale_tied_logits=scale,
    )  # fmt: skip


def _stack(cfg: Config, stack: str, path: str, cross: bool) -> list[Entry]:
    blk = f"{stack}.block.{{i}}.layer."
    ff = f"{blk}{2 if cross else 1}."
    rows = [
        *norm(f"{path}/attn_norm", f"{blk}0.layer_norm", False),
        *(
            Entry(f"{path}/attn/{x}", f"{blk}0.SelfAttention.{x}.weight", f"({a} d_kv) d_model")
            for x, a in (("q", "Q"), ("k", "KV"), ("v", "KV"))
        ),
        Entry(f"{path}/attn/o", f"{blk}0.SelfAttention.o.weight", "d_model (Q d_kv)"),
        *norm(f"{path}/ffn_norm", f"{ff}layer_norm", False),
        Entry(f"{path}/ffn/wo", f"{ff}DenseReluDense.wo.weight", "d_model d_ff"),
    ]
    if cfg.ffn.startswith("gated_"):
        rows.append(Entry(f"{path}/ffn/wi", f"{ff}DenseReluDense.wi_0.weight", "d_ff d_model"))
        rows.append(Entry(f"{path}/ffn/wg", f"{ff}DenseReluDense.wi_1.weight", "d_ff d_model"))
    else:
        rows.append(Entry(f"{path}/ffn/wi", f"{ff}DenseReluDense.wi.weight", "d_ff d_model"))
    if cross:
        rows += norm(f"{path}/cross_norm", f"{blk}1.layer_norm", False)
        rows += [
            Entry(f"{path}/cross/{x}", f"{blk}1.EncDecAttention.{x}.weight", "(Q d_kv) d_model")
            for x in "qkv"
        ]
        rows.append(
            Entry(f"{path}/cross/o", f"{blk}1.EncDecAttention.o.weight", "d_model (Q d_kv)")
        )
    return rows


def table(cfg: Config, prefix: str) -> list[Entry]:
    rel = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    rows = [
        Entry("embed", "shared.weight", "vocab d_model"),
        Entry("encoder_relative", f"encoder.{rel}", "buckets heads"),
        Entry("relative", f"decoder.{rel}", "buckets heads"),
        *norm("encoder_norm", "encoder.final_layer_norm", False),
        *norm("final_norm", "decoder.final_layer_norm", False),
        *_stack(cfg, "encoder", "encoder", cross=False),
        *_stack(cfg, "decoder", "layers", cross=True),
    ]
    return rows + (
        [] if cfg.shared_embedding else [Entry("softmax", "lm_head.weight", "vocab d_model")]
    )


FAMILY = Family(
    "t5", config, table, "encdec", ("",), "shared.weight", "T5ForConditionalGeneration",
    ignored=(r"^(encoder|decoder)\.embed_tokens\.weight$",),  # copies of shared.weight
    tokens=("eos",),  # text </s>
    defaults=dict(  # T5Config's
        feed_forward_proj="relu", layer_norm_epsilon=1e-6, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, is_decoder=False,
    ),
)  # fmt: skip
