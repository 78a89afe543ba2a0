"""The forward pass of every family in models/families/ against transformers' eager
PyTorch (`python -m benchmarks.zoo_vs_hf --families`): each family's model built by
transformers from a small config (its options as tests/test_families.py's cases set them:
grouped-query heads, windows, caps, partial rotary...), saved, loaded with
`models.hub.load`, its logits checked equal, then both forward passes timed by
benchmarks/fair.py (single-threaded, CPU time, alternated)."""

from __future__ import annotations

import tempfile

import numpy as np

from benchmarks import fair
from models import hub, zoo

TOLERANCE = 1e-4  # max |difference| of the logits over the largest, float32


def configs(layers: int, d: int, heads: int, vocab: int, length: int) -> dict:
    """family -> (transformers model class name, config class name, config kwargs)."""
    kv, ff, half = max(1, heads // 2), 2 * d, {"partial_rotary_factor": 0.5}
    llama = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv,
                 max_position_embeddings=length)  # fmt: skip
    encoder = dict(vocab_size=vocab, hidden_size=d, intermediate_size=ff,
                   num_hidden_layers=layers, num_attention_heads=heads,
                   max_position_embeddings=length + 2)  # fmt: skip
    window = dict(sliding_window=length // 4)
    gemma = dict(llama, head_dim=d // heads)
    mha = {k: v for k, v in llama.items() if k != "num_key_value_heads"}
    return {
        "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
            vocab_size=vocab, n_embd=d, n_layer=layers, n_head=heads, n_positions=length,
            bos_token_id=0, eos_token_id=0)),
        "llama": ("LlamaForCausalLM", "LlamaConfig", llama),
        "mistral": ("MistralForCausalLM", "MistralConfig", {**llama, **window}),
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", llama),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", llama),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", {
            **llama, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
        "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {
            **mha, "rope_parameters": {
                "rope_type": "default", "rope_theta": 1e4, **half}}),
        "opt": ("OPTForCausalLM", "OPTConfig", dict(
            vocab_size=vocab, hidden_size=d, ffn_dim=ff, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=length, pad_token_id=1)),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", gemma),
        "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {
            **gemma, **window, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}),
        "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextConfig", {
            **gemma, **window, "sliding_window_pattern": 2}),
        "t5": ("T5ForConditionalGeneration", "T5Config", dict(
            vocab_size=vocab, d_model=d, d_ff=ff, d_kv=d // heads, num_layers=layers,
            num_heads=heads)),
        "bert": ("BertForMaskedLM", "BertConfig", encoder),
        "roberta": ("RobertaForMaskedLM", "RobertaConfig", {**encoder, "type_vocab_size": 1}),
        "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(
            vocab_size=vocab, dim=d, hidden_dim=ff, n_layers=layers, n_heads=heads,
            max_position_embeddings=length)),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(  # a dense layer, MoE
            llama, num_key_value_heads=heads, moe_intermediate_size=d // 2, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=d // 2, q_lora_rank=d,
            qk_rope_head_dim=max(2, d // heads // 4 * 2), qk_nope_head_dim=d // heads,
            v_head_dim=d // heads, num_nextn_predict_layers=0)),
    }  # fmt: skip


def both_sides(name: str, spec: tuple, ids: np.ndarray):
    """(zoo forward, PyTorch forward, max |logit difference| relative to the largest)."""
    import torch
    import transformers

    model_cls, config_cls, kwargs = spec
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    with torch.no_grad():  # non-trivial biases and norm scales
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    folder = tempfile.mkdtemp(prefix=f"zoo_{name}_")
    model.save_pretrained(folder)
    loaded = hub.load(folder)
    t_ids = torch.tensor(ids).long()
    # an encoder-decoder (T5) decodes the same ids it encodes
    decodes = "decoder_inputs" in zoo.MODELS[hub.FAMILIES[name].model].needs
    extra = {"decoder_input_ids": t_ids} if decodes else {}
    z_extra = {"decoder_input_ids": ids} if decodes else {}

    def torch_forward():
        with torch.no_grad():
            return model(input_ids=t_ids, **extra).logits

    def zoo_forward():
        return loaded.logits(ids, **z_extra).data.block_until_ready()

    want = torch_forward().numpy()
    got = np.asarray(loaded.logits(ids, **z_extra).transpose("batch", "length", "vocab").data)
    return zoo_forward, torch_forward, float(np.abs(got - want).max() / np.abs(want).max())


def run(args, names: list[str]) -> dict:
    """{family: {"times": {side: seconds per round}, "error": relative max difference}}."""
    specs = configs(args.layers, args.d_model, args.heads, args.vocab, args.length)
    ids = np.random.default_rng(0).integers(2, args.vocab, (args.batch, args.length))
    ids = ids.astype(np.int32)
    out = {}
    for name in names:
        zoo_forward, torch_forward, error = both_sides(name, specs[name], ids)
        if error > TOLERANCE:  # timing two different computations would say nothing
            raise SystemExit(f"{name}: the zoo's logits differ from transformers' by {error:.1e}")
        times = fair.alternate({"namedmesh": zoo_forward, "PyTorch eager": torch_forward},
                               args.repeats)  # fmt: skip
        out[name] = {"times": times, "error": error}
    return out


def table(results: dict) -> str:
    lines = ["| family | namedmesh ms | PyTorch eager ms | namedmesh / PyTorch | max logit diff |",
             "|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        z, t = r["times"]["namedmesh"], r["times"]["PyTorch eager"]
        cells = [name, fair.cell(z), fair.cell(t), fair.ratio(z, t), f"{r['error']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
