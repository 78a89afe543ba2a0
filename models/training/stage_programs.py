"""One pipeline stage of the decoder LM as a program of its own, for planning
(lowering/stages.py `staged_choice`, `namedmesh plan --stages`).

A stage holds some layers of each of the model's stacks (`stacks`: DeepSeek-V3's 3 dense
then 58 mixture-of-experts layers) and only its part of the rest: the first stage embeds
the tokens (and holds the embedding), the last holds the final norm, the output
projection and the loss; a stage between takes the previous stage's activation
(`hidden`: batch, length, d_model in the compute dtype) and its loss is the dot of its
output with the gradient the next stage sends back (`grad`), whose backward pass is the
stage's. A model with tied embeddings holds the embedding on the first and the last
stage both, as a pipeline must.
"""

from __future__ import annotations

import numpy as np

import namedmesh as nm
from models import transformer
from models.architecture import Config
from models.layers.common import compute_dtype, cross_entropy
from models.training import objectives

# embedding_shapes' parameters that the loss head reads (the last stage's)
HEAD = ("final_norm", "mlm", "project_out", "softmax")
# those every stage reads (T5's relative bias of the layers)
EVERY = ("relative",)


def stacks(cfg: Config) -> list[int]:
    """The decoder's layer stacks in order: [dense, mixture-of-experts] where it has dense
    layers first (DeepSeek-V3's 3 and 58), else [layers]."""
    k = cfg.dense_layers
    return [k, cfg.layers - k] if k else [cfg.layers]


def stage_config(cfg: Config, counts) -> Config:
    """`cfg` with the layers of a stage holding `counts` layers per stack."""
    if len(counts) == 2 and counts[0] and counts[1]:
        return cfg.replace(dense_layers=counts[0], layers=sum(counts))
    if len(counts) == 2 and counts[0]:
        return transformer.dense_config(cfg).replace(layers=counts[0])
    return cfg.replace(dense_layers=0, layers=counts[-1])


def stage_parameters(cfg: Config, first: bool, last: bool) -> dict:
    """The Params of a stage of `cfg` (a stage_config): its layers, and of the rest the
    first's (the embedding) or the last's (the head) part."""
    shapes = transformer.lm_shapes(cfg)
    rest = transformer.embedding_shapes(cfg)
    head = set(HEAD) | ({"embed"} if "softmax" not in rest else set())
    keep = {k for k in shapes if k not in rest or k in EVERY}
    keep |= {k for k in rest if (first and k not in HEAD) or (last and k in head)}
    return {k: v for k, v in shapes.items() if k in keep}


def stage_program(cfg: Config, counts, first: bool, last: bool, batch: int, length: int):
    """(loss, (params, inputs)) of one stage of `cfg` (remat, dtype and attention set)
    holding `counts` layers per stack, on a microbatch of `batch` rows of `length`
    tokens, on abstract inputs."""
    c = stage_config(cfg, counts).replace(batch=batch, length=length)
    params = transformer.abstract(stage_parameters(c, first, last))
    rows = objectives.abstract_batch("lm", batch, length)
    hidden = {"batch": batch, "length": length, "d_model": c.d_model}
    act = nm.abstract(hidden, compute_dtype(c))
    inputs = {"inputs": rows["inputs"]} if first else {"hidden": act}
    if last:
        inputs.update(targets=rows["targets"], weights=rows["weights"])
    else:
        inputs["grad"] = nm.abstract(hidden, compute_dtype(c))  # the next stage's

    def loss(p, b):
        p = transformer.compute_params(p, c)
        x = transformer.embed_inputs(p, b["inputs"], c) if first else b["hidden"]
        bias = None
        if "relative" in p:
            bias = transformer.bucket_bias(p["relative"], c, length, False)
        x, aux = transformer.run_layers(x, p, c, None, causal=True, bias=bias)
        if last:
            out = cross_entropy(transformer.output_logits(p, x, c), b["targets"], b["weights"])
        else:
            out = nm.sum(nm.astype(x * b["grad"], np.float32))
        return out if aux is None else out + aux["balance"] * c.moe_loss

    return loss, (params, inputs)
