"""benchmarks/peak.py's matmul flop count of a training step, against a hand count of
each product's (m, k) x (k, n) shapes (2mkn flops each), and its reading of configs."""

from types import SimpleNamespace

import pytest

from benchmarks import peak


def hand_count(batch, length, d, heads, kv, hd, ff, mats, vocab, active=1, experts=0,
               shared_ff=0, head_transform=False):  # fmt: skip
    """The forward's products one by one, times 3 (the backward: two per product)."""
    t = batch * length
    products = [
        (t, d, heads * hd),  # q
        (t, d, kv * hd),
        (t, d, kv * hd),  # k, v
        (t, heads * hd, d),  # output projection
        *[(length, hd, length)] * (batch * heads),  # scores, each sequence and head
        *[(length, length, hd)] * (batch * heads),  # probabilities times values
        *[(t, d, ff)] * ((mats - 1) * active),  # the FFN's in (and gate), each active expert
        *[(t, ff, d)] * active,  # its out
    ]
    products += [(t, d, experts)] if experts else []
    products += [(t, d, shared_ff), (t, d, shared_ff), (t, shared_ff, d)] if shared_ff else []
    layer = sum(2 * m * k * n for m, k, n in products)
    head = [(t, d, vocab)] + ([(t, d, d)] if head_transform else [])
    return 3 * (layer + sum(2 * m * k * n for m, k, n in head))


@pytest.mark.parametrize(
    "shape, batch, length",
    [
        (peak.Shape(1, 4, 2, 1, 2, 8, 3, 10), 1, 3),
        (peak.Shape(1, 6, 3, 3, 2, 5, 2, 7), 2, 4),  # ungated, no grouped heads
        (peak.Shape(1, 4, 2, 2, 2, 8, 3, 10, active=2, experts=4), 2, 3),  # MoE, top 2
        (peak.Shape(1, 4, 2, 2, 2, 8, 3, 10, 2, 5, shared_ff=6), 2, 3),  # and a shared expert
        (peak.Shape(1, 6, 3, 3, 2, 5, 2, 7, head_transform=True), 2, 4),  # a masked LM's head
    ],
)
def test_step_flops_equal_a_hand_count_of_the_products(shape, batch, length):
    s = shape
    want = hand_count(batch, length, s.d_model, s.heads, s.kv_heads, s.head_dim, s.d_ff,
                      s.ffn_mats, s.vocab, s.active, s.experts, s.shared_ff,
                      s.head_transform)  # fmt: skip
    assert peak.step_flops(s, batch, length) == want
    two = peak.Shape(**{**s.__dict__, "layers": 2})
    head = s.vocab + (s.d_model if s.head_transform else 0)
    layer_only = want - 3 * 2 * batch * length * s.d_model * head
    assert peak.step_flops(two, batch, length) == want + layer_only


def test_shape_of_reads_llama_mixtral_and_gpt2_configs():
    llama = SimpleNamespace(hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                            num_hidden_layers=4, intermediate_size=1024, vocab_size=8192,
                            head_dim=None)  # fmt: skip
    assert peak.shape_of(llama) == peak.Shape(4, 512, 8, 4, 64, 1024, 3, 8192)
    mixtral = SimpleNamespace(**llama.__dict__, num_local_experts=8, num_experts_per_tok=2)
    assert peak.shape_of(mixtral).active == 2 and peak.shape_of(mixtral).experts == 8
    gpt2 = SimpleNamespace(n_embd=256, n_head=4, n_layer=4, n_inner=1024, vocab_size=256)
    assert peak.shape_of(gpt2) == peak.Shape(4, 256, 4, 4, 64, 1024, 2, 256)
    with pytest.raises(KeyError, match="hidden_size"):
        peak.shape_of(SimpleNamespace(vocab_size=3))


def test_shape_of_reads_the_other_families_field_names_and_refuses_what_it_cannot_count():
    transformers = pytest.importorskip("transformers")
    opt = transformers.OPTConfig(vocab_size=50, hidden_size=16, ffn_dim=24, num_hidden_layers=2,
                                 num_attention_heads=4)  # fmt: skip
    assert peak.shape_of(opt) == peak.Shape(2, 16, 4, 4, 4, 24, 2, 50)  # ungated FFN
    distil = transformers.DistilBertConfig(vocab_size=50, dim=16, hidden_dim=24, n_layers=2,
                                           n_heads=4)  # fmt: skip
    assert peak.shape_of(distil) == peak.Shape(2, 16, 4, 4, 4, 24, 2, 50, head_transform=True)
    qwen = transformers.Qwen2MoeConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=16)  # fmt: skip
    # the experts' width, not intermediate_size; the router's 8 outputs and the shared
    # expert's gate's one
    assert peak.shape_of(qwen) == peak.Shape(2, 16, 4, 2, 4, 8, 3, 50, 2, 9, shared_ff=16)
    for config in (transformers.T5Config(), transformers.DeepseekV3Config()):
        with pytest.raises(KeyError, match=f"{config.model_type}: .*not counted"):
            peak.shape_of(config)
