"""`python -m models.generate`: continue a prompt with a trained decoder LM.

    python -m models.generate --checkpoint runs/tiny --prompt "The assert statement" \\
        --mode greedy|sample|beam --max-new 200

Decoding runs one position at a time over a KV cache of `length` slots (the config's
training length): each step embeds one token, writes its keys and values into the
cache and attends over it. When the cache is full, the last half of the text is
written into a fresh cache and decoding goes on (positions restart at 0, as in
training). Greedy takes the likeliest token, sample draws from softmax(logits / T),
beam keeps the `--beams` likeliest continuations.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import namedmesh as nm
from models import checkpoint, config, data, hub, transformer, zoo
from models.config import Config
from models.layers import head_sizes
from models.train import Parser


def init_cache(cfg: Config, batch: int, slots: int | None = None) -> dict:
    """Empty keys and values for every layer: (layers, batch, memory, heads, d_kv), with
    kv_heads in place of heads under grouped-query attention; `slots` positions
    (cfg.length by default)."""
    heads = head_sizes(cfg, kv=True)
    dims = ("layers", "batch", "memory", *heads, "d_kv")
    shape = (cfg.layers, batch, slots or cfg.length, *heads.values(), cfg.d_kv)
    return {k: nm.tensor(jnp.zeros(shape, jnp.float32), dims) for k in ("k", "v")}


def decode_step(params: dict, tokens: nm.Tensor, position, cache: dict, cfg: Config, encoded=None):
    """(logits (batch, vocab), new cache): the next-token logits after `tokens` (batch,
    length=1; ints) at `position` (a 0-d int Tensor), given the cache of the positions
    before. An encoder-decoder's decoder takes `encoded`, the (memory, padding bias) of
    `transformer.encode`, and attends to it in every layer."""
    x = transformer.embed(tokens, params["embed"])
    if "pos" in params:
        x = x + nm.gather(params["pos"].rename(length="memory"), "memory", position)
    x = transformer.embed_extras(params, x, cfg)
    slots = cache["k"].size_of("memory")
    bias = None
    if "relative" in params:  # T5: the bias row of this position, shared by all layers
        bias = transformer.bucket_bias(params["relative"], cfg, slots, False, position)
    memory, memory_bias = (None, None) if encoded is None else encoded

    def body(h, xs):
        p, k, v = xs
        h, _, new = transformer.block(
            h,
            p,
            cfg,
            None,
            causal=True,
            bias=bias,
            memory=memory,
            memory_bias=memory_bias,
            cache={"k": k, "v": v},
            position=position,
        )
        return h, (new["k"], new["v"])

    x, (k, v) = nm.scan(body, x, (params["layers"], cache["k"], cache["v"]), "layers")
    logits = transformer.output_logits(params, x, cfg).sum("length")
    return logits, {"k": k, "v": v}


class Decoder:
    """Decoding with a jitted `decode_step` for one model's parameters, over a cache of
    `slots` positions (cfg.length by default)."""

    def __init__(self, params: dict, cfg: Config, slots: int | None = None):
        self.params, self.cfg, self.slots = params, cfg, slots or cfg.length
        self._step = jax.jit(lambda p, t, i, c, e: decode_step(p, t, i, c, cfg, e))
        self._encode = jax.jit(lambda p, b: transformer.encode(p, b, cfg)[:2])
        self.encoded = None  # an encoder-decoder's (memory, padding bias): see `encode`

    def step(self, tokens: np.ndarray, position: int, cache: dict):
        """(log-probabilities (batch, vocab) as NumPy, new cache)."""
        t = nm.tensor(jnp.asarray(tokens, jnp.int32)[:, None], ("batch", "length"))
        i = nm.tensor(jnp.int32(position), ())
        logits, cache = self._step(self.params, t, i, cache, self.encoded)
        return np.asarray(jax.nn.log_softmax(logits.transpose("batch", "vocab").data, -1)), cache

    def prefill(self, rows: np.ndarray):
        """(log-probs after the last token, cache, next position) for token rows
        (batch, n), n <= slots."""
        cache = init_cache(self.cfg, rows.shape[0], self.slots)
        for i in range(rows.shape[1]):
            logp, cache = self.step(rows[:, i], i, cache)
        return logp, cache, rows.shape[1]

    def encode(self, inputs: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Encode an encoder-decoder's inputs (batch, n; weights 1 real, 0 padding) once;
        the following steps' cross-attention reads this memory."""
        inputs = np.asarray(inputs, np.int32)
        w = np.ones(inputs.shape, np.float32) if weights is None else weights
        batch = {
            "inputs": nm.tensor(inputs, ("batch", "length")),
            "input_weights": nm.tensor(np.asarray(w, np.float32), ("batch", "length")),
        }
        self.encoded = self._encode(self.params, batch)

    def greedy_rows(self, rows: np.ndarray, max_new: int) -> np.ndarray:
        """The `max_new` likeliest-next tokens after each row of `rows` (batch, n), by
        batch: the decoder's start tokens of an encoder-decoder after `encode`."""
        logp, cache, pos = self.prefill(np.asarray(rows))
        out = []
        for _ in range(max_new):
            out.append(logp.argmax(-1))
            rows = np.concatenate([rows, out[-1][:, None]], axis=1)
            logp, cache, pos = self._advance(rows, cache, pos)
        return np.stack(out, axis=1)

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        mode: str = "greedy",
        *,
        beams: int = 4,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> list[int]:
        """The prompt's continuation: `max_new` new tokens."""
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if mode == "beam":
            return self.beam(prompt, max_new, beams)[0]
        rng = np.random.default_rng(seed)
        rows = np.asarray([prompt[-self.slots :]])
        logp, cache, pos = self.prefill(rows)
        out = []
        for _ in range(max_new):
            if mode == "greedy":
                tok = int(logp[0].argmax())
            elif mode == "sample":
                p = np.exp((logp[0] - logp[0].max()) / temperature)
                tok = int(rng.choice(len(p), p=p / p.sum()))
            else:
                raise ValueError(f"mode must be greedy, sample or beam, got {mode!r}")
            out.append(tok)
            rows = np.concatenate([rows, [[tok]]], axis=1)
            logp, cache, pos = self._advance(rows, cache, pos)
        return out

    def _advance(self, rows: np.ndarray, cache: dict, pos: int):
        """Feed the last token of `rows`; refill a fresh cache when this one is full."""
        if pos == self.slots:
            return self.prefill(rows[:, -(self.slots // 2) :])
        logp, cache = self.step(rows[:, -1], pos, cache)
        return logp, cache, pos + 1

    def beam(self, prompt: list[int], max_new: int, beams: int) -> tuple[list[int], float]:
        """(the best continuation, its log-probability) by beam search of width `beams`."""
        rows = np.asarray([prompt[-self.slots :]])
        logp, cache, pos = self.prefill(rows)
        seqs, scores = np.zeros((1, 0), int), np.zeros(1)
        for _ in range(max_new):
            total = scores[:, None] + logp  # (beams, vocab)
            best = np.argsort(-total, axis=None, kind="stable")[:beams]
            parent, tok = np.unravel_index(best, total.shape)
            seqs = np.concatenate([seqs[parent], tok[:, None]], axis=1)
            scores = total[parent, tok]
            cache = {k: _rows(v, parent) for k, v in cache.items()}
            rows = np.concatenate([rows[np.minimum(parent, len(rows) - 1)], tok[:, None]], 1)
            logp, cache, pos = self._advance(rows, cache, pos)
        return [int(t) for t in seqs[0]], float(scores[0])


def _rows(t: nm.Tensor, index: np.ndarray) -> nm.Tensor:
    """The batch rows `index` of t (a beam's parent hypotheses)."""
    axis = t.dims.index("batch")
    return nm.tensor(jnp.take(t.data, jnp.asarray(index), axis=axis), t.dims)


def load(run: str | Path):
    """(params, cfg, tokenizer) of the latest checkpoint of a training run's folder, or
    of a Hugging Face folder (config.json, safetensors, tokenizer.json) of a decoder LM."""
    run = Path(run)
    if (run / "config.json").exists() and not (run / "run.json").exists():
        return load_hub(run)
    if not (run / "run.json").exists() or checkpoint.latest_step(run) is None:
        raise checkpoint.CheckpointError(f"{run}: no run.json and checkpoint to load")
    flags = json.loads((run / "run.json").read_text())
    model = zoo.get(flags["model"])
    if model.objective != "lm":
        raise checkpoint.CheckpointError(
            f"{run} holds a {flags['model']!r} model; generation needs a decoder LM (lm, moe)"
        )
    if flags.get("init_from"):  # fine-tuned from a Hugging Face folder: its config
        cfg = hub.config_of(flags["init_from"])[1]
    else:
        cfg = model.configure(config.get(flags["config"])).replace(vocab=flags["vocab"])
    cfg = cfg.replace(**{k: flags[k] for k in ("batch", "length") if flags.get(k)})
    # The parameters alone, by name: the optimizer's state stays on disk.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(  # over the Tensors' data: abstract, on one device
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        transformer.abstract(model.shapes(cfg)),
    )
    params, _ = checkpoint.restore_params(run, target)
    return params, cfg, data.load_tokenizer(run)


def load_hub(folder: Path):
    """(params, cfg, tokenizer) of a Hugging Face folder holding a decoder LM."""
    model = hub.load(folder)
    if model.family not in hub.DECODERS:
        raise hub.UnsupportedModelError(
            f"{folder} holds a {model.family} model; generation needs a decoder LM "
            f"({', '.join(hub.DECODERS)})"
        )
    if model.tokenizer is None:
        raise hub.MissingFileError(f"{folder}: no tokenizer.json to encode the prompt with")
    return model.params, model.config, data.BPETokenizer(model.tokenizer)


def main(argv=None) -> int:
    p = Parser(prog="python -m models.generate", description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a training run's --out folder, or a Hugging Face folder (gpt2, llama)",
    )
    p.add_argument("--prompt", default="The assert statement")
    p.add_argument("--mode", default="greedy", choices=["greedy", "sample", "beam"])
    p.add_argument("--max-new", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--beams", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        params, cfg, tokenizer = load(args.checkpoint)
    except (checkpoint.CheckpointError, KeyError) as e:
        print(f"models.generate: error: {e}", file=sys.stderr)
        return 2
    prompt = [int(i) for i in tokenizer.encode(args.prompt)]
    dec = Decoder(params, cfg)
    out = dec.generate(
        prompt,
        args.max_new,
        args.mode,
        beams=args.beams,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(args.prompt + tokenizer.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
