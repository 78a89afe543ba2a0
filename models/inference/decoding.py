"""Decoding with a KV cache: a batch of right-padded prompts prefilled in one forward
pass, then one token per row per step at each row's own position, chosen greedily or
by sampling (models/inference/sampling.py), until an end token or the maximum length; beam
search; an encoder-decoder's decoder over an encoding made once. `Decoder` runs it on
one device or lowered under a mesh and layout. The command line is models/cli/generate.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import namedmesh as nm
from lowering import Layout, Mesh, lower
from models import transformer
from models.architecture import Config
from models.inference.sampling import Sampling, choose
from models.layers.common import compute_dtype, layer_constants, project_kv
from namedmesh.errors import ParameterError


def init_cache(cfg: Config, batch: int, slots: int | None = None) -> dict:
    """Empty keys and values for every layer: (layers, batch, memory, heads, d_kv), with
    kv_heads in place of heads under grouped-query attention (latent attention: its
    "latent" and "k_rope", models/layers/mla.py); `slots` positions
    (cfg.length by default), in the config's compute dtype; under capacity routing,
    "route" (layers, batch, memory, experts): the experts each position chose, whose
    counts before a position are the expert queues it joins. Inside a lowered program
    the zeros are laid out by the layout's rules like any value. The decoding programs
    read it split by layer (`layer_caches`)."""
    sizes = {"layers": cfg.layers, "batch": batch, "memory": slots or cfg.length}
    dtype = compute_dtype(cfg)
    entries = transformer.ATTENTIONS[cfg.attention_variant].cache(cfg)
    cache = {k: nm.zeros({**sizes, **more}, dtype) for k, more in entries.items()}
    if cfg.experts and cfg.routing == "capacity":  # each position's experts, queued
        cache["route"] = nm.zeros({**sizes, "experts": cfg.experts}, np.float32)
    return cache


# The decoding programs read each layer's weights and cache as buffers of their own:
# XLA:CPU copies a slice of a stacked array before a matmul reads it, so a layer scan
# over stacked weights and caches copied every weight matrix and the attended part of
# every cache once per layer per step (most of a batch-8 step's time).
STACKS = ("dense", "layers")  # a decoder's stacks of layers, in the cache's order


def unstacked(params: dict) -> dict:
    """`params` with each decoder stack (params["dense"], params["layers"]) as a tuple of
    its layers' parameters, their `layers` dim dropped; params already unstacked are
    returned as they are. `Decoder` unstacks its parameters once."""
    out = dict(params)
    for name in STACKS:
        if isinstance(params.get(name), dict):
            out[name] = _split_layers(params[name])
    return out


def _split_layers(tree: dict) -> tuple:
    n = jax.tree_util.tree_leaves(tree, is_leaf=_is_tensor)[0].size_of("layers")
    return tuple(_layer(tree, i) for i in range(n))


def _layer(tree: dict, i: int) -> dict:
    return jax.tree_util.tree_map(lambda t: nm.isel(t, layers=i), tree, is_leaf=_is_tensor)


def _is_tensor(t) -> bool:
    return isinstance(t, nm.Tensor)


def step_layout(t: nm.Tensor) -> nm.Tensor:
    """A layer's cache entry with `memory` just before its last dim: keys and values
    (batch, kv_heads, memory, d_kv), each head's positions rows of one matrix, which the
    score matmul (q.k, both minor dims contracted) and the weights' (w.v) read as they
    lie, with no transposed copy per step; a latent (batch, memory, latent) as it is."""
    rest = [d for d in t.dims if d != "memory"]
    return t.transpose(*rest[:-1], "memory", rest[-1])


def layer_caches(cache) -> tuple:
    """A cache as the decoding programs take it, a tuple of one {name: Tensor} per layer
    in `step_layout` (the dense stack's layers first): `init_cache`'s stacked cache split
    by layer; a tuple of layers as it is."""
    if not isinstance(cache, dict):
        return tuple(cache)
    n = next(iter(cache.values())).size_of("layers")
    return tuple({k: step_layout(nm.isel(t, layers=i)) for k, t in cache.items()} for i in range(n))


def cache_slots(cache: tuple) -> int:
    """The positions a tuple of layer caches holds (its capacity)."""
    return transformer.slots_of(cache[0])


def grown(cache: tuple, slots: int) -> tuple:
    """Layer caches padded with empty slots up to `slots` positions."""
    more = {"memory": (0, slots - cache_slots(cache))}
    return tuple({k: nm.pad(t, more) for k, t in c.items()} for c in cache)


def encode_memory(params: dict, batch: dict, cfg: Config) -> tuple[tuple, nm.Tensor]:
    """(cross keys and values, padding bias (batch, memory)) of an encoder-decoder: the
    encoder run once over batch["inputs"] (batch["input_weights"]: 1 real, 0 padding),
    and its output projected by every decoder layer's cross-attention, one {"k", "v"}
    (batch, memory, heads or kv_heads, d_kv) per layer in the compute dtype. Decoding
    steps read them beside the self-attention cache instead of projecting the memory
    again; inside a lowered program they are laid out by the layout's rules like it."""
    params = unstacked(transformer.compute_params(params, cfg))
    memory, bias, _ = transformer.encode(params, batch, cfg)
    return tuple(project_kv(memory, p["cross"], cfg) for p in params["layers"]), bias


def _run_layers(params: dict, x: nm.Tensor, cfg: Config, caches: tuple, position, encoded):
    """(hidden states, each layer's cache with x's keys and values written): the
    decoder's layers one after another (unrolled; `unstacked` params) over x at
    `position`, layer i attending over caches[i] (its slots hold every position x's
    queries see, x's own included once written there), and an encoder-decoder's
    `encoded` (per-layer cross keys and values, bias) of `encode_memory`."""
    slots = cache_slots(caches)
    bias = None
    if "relative" in params:  # T5: the bias rows of these positions, shared by all layers
        bias = transformer.bucket_bias(params["relative"], cfg, slots, False, position)
    cross, memory_bias = (None, None) if encoded is None else encoded
    configs = {"dense": transformer.dense_config(cfg), "layers": cfg}
    written = []
    for stack in (s for s in STACKS if s in params):
        c = configs[stack]
        consts = layer_constants(c, slots)  # each layer's window and rotary frequencies
        for j, p in enumerate(params[stack]):
            layer = None if consts is None else {k: nm.isel(t, layers=j) for k, t in consts.items()}
            ctx = transformer.Context(c, bias=bias, layer=layer)
            kv = None if cross is None or stack == "dense" else cross[j]
            memory = None if kv is None else transformer.Cross(kv, memory_bias)
            x, _, new = transformer.decode_block(x, p, ctx, caches[len(written)], position, memory)
            written.append(new)
    return x, tuple(written)


def prefill_step(
    params: dict, tokens: nm.Tensor, last, cfg: Config, slots: int, encoded=None
) -> tuple[nm.Tensor, tuple]:
    """(logits, cache) after one forward pass over the prompts `tokens` (batch, length;
    ints, right-padded) that writes their keys and values into the first `length` slots
    of a fresh cache of `slots` positions (`layer_caches`' form); the pass attends over
    those `length` slots alone. `last` (int Tensor over batch) is each row's last real
    position: logits (batch, vocab) after it; None: logits (batch, length, vocab) at
    every position. The causal mask keeps a row's padding out of its real positions'
    attention, and the steps that follow overwrite the padded slots before any query
    may see them, so a padded row decodes as it would alone."""
    params = unstacked(transformer.compute_params(params, cfg))
    n = tokens.size_of("length")
    x = transformer.embed_inputs(params, tokens, cfg)
    empty = layer_caches(init_cache(cfg, tokens.size_of("batch"), n))
    x, cache = _run_layers(params, x, cfg, empty, nm.arange("length", n), encoded)
    if last is not None:  # the output projection only where a token is chosen
        x = nm.gather(x, "length", last)
    return transformer.output_logits(params, x, cfg), grown(cache, slots)


def bucket(filled: int, slots: int, least: int = 64) -> int:
    """The cache slots a step attends over when its rows hold at most `filled` positions
    (their new one included): the next power of two >= filled, at least `least`, at most
    `slots`. A few compiled steps serve every length, each attending over at most twice
    the filled slots."""
    return min(slots, max(least, 1 << max(filled - 1, 0).bit_length()))


def decode_step(
    params: dict, tokens: nm.Tensor, position, cache, cfg: Config, encoded=None
) -> tuple[nm.Tensor, tuple]:
    """(logits (batch, vocab), new cache): the next-token logits after `tokens` (batch,
    length=1; ints) at `position` (an int Tensor: 0-d, or over batch for rows at
    different positions), given the cache of the positions before (`layer_caches`' form,
    or `init_cache`'s). The step attends over every slot of the cache (`Decoder` keeps
    it `bucket`-sized, a few slots past the longest row) and writes the new keys and
    values with `nm.update_slice`, in place when the cache's buffers are donated
    (`Decoder` does). An encoder-decoder's decoder takes `encoded`, the (cross keys and
    values, padding bias) of `encode_memory`, and attends to them in every layer."""
    params = unstacked(transformer.compute_params(params, cfg))
    x = transformer.embed_tokens(params, tokens, cfg)
    if "pos" in params:
        x = x + cfg.parts.positions(params["pos"], tokens, position)
    x = transformer.embed_extras(params, x, cfg)
    x, cache = _run_layers(params, x, cfg, layer_caches(cache), position, encoded)
    logits = transformer.output_logits(params, x, cfg).sum("length")
    return logits, cache


def _picked(step: tuple, key, how: Sampling | None) -> tuple:
    """(the tokens `choose` picks from a step's logits, its cache)."""
    logits, cache = step
    return choose(logits.transpose("batch", "vocab").data, key, how), cache


MODES = ("greedy", "sample", "beam")


def pad_rows(prompts, vocab: int, limit: int, multiple: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """(rows (batch, n) right-padded with 0, lengths (batch,)) of a list of token lists;
    n is the longest prompt rounded up to `multiple` (at most `limit`), so batches of
    similar lengths share one compiled prefill. ParameterError for no prompts, an empty
    or over-long prompt, or a token outside the vocabulary."""
    prompts = [np.asarray(p) for p in prompts]
    if not prompts:
        raise ParameterError("prompts: no prompt to decode")
    for i, p in enumerate(prompts):
        if not p.size:
            raise ParameterError(f"prompt {i} is empty: a prompt needs at least one token")
        if p.ndim != 1 or p.dtype.kind not in "iu":  # floats would be truncated silently
            raise ParameterError(
                f"prompt {i} must be a flat list of int token ids, got {p.dtype} of shape {p.shape}"
            )
        if len(p) > limit:
            raise ParameterError(
                f"prompt {i} has {len(p)} tokens, more than max_length (--max-length) {limit}"
            )
        if (bad := p[(p < 0) | (p >= vocab)]).size:
            raise ParameterError(
                f"prompt {i}: token {int(bad[0])} is outside the vocabulary [0, {vocab})"
            )
    lengths = np.array([len(p) for p in prompts])
    n = min(limit, -(-int(lengths.max()) // multiple) * multiple)
    rows = np.zeros((len(prompts), n), np.int32)
    for i, p in enumerate(prompts):
        rows[i, : len(p)] = p
    return rows, lengths


def _widen(encoded, rows: int):
    """An encoding of one input repeated for `rows` rows (a beam's hypotheses)."""
    index = np.zeros(rows, np.int64)
    return jax.tree_util.tree_map(
        lambda t: _rows(t, index), encoded, is_leaf=lambda t: isinstance(t, nm.Tensor)
    )


def _ints(x, dims) -> nm.Tensor:
    return nm.tensor(jnp.asarray(np.asarray(x, np.int32)), dims)  # int32 on the host


class Decoder:
    """Decoding with one model's parameters, each layer's in buffers of its own
    (`unstacked`), over a KV cache of at most `slots` positions per layer (cfg.length by
    default; the most tokens a row holds, prompt included) that holds the `bucket` of
    its longest row and grows by buckets: one compiled prefill per prompt width, one
    compiled step per cache size, the cache donated to it (written in place). With a
    `mesh` and `layout`,
    prefill, step and encoder are lowered under the layout: the cache, the parameters
    and the activations are split by its rules (`batch:data;heads:model` splits the
    cache's batch and heads) and the tokens are those of one device."""

    def __init__(
        self,
        params: dict,
        cfg: Config,
        slots: int | None = None,
        mesh: Mesh | None = None,
        layout: Layout | str | None = None,
    ):
        self.cfg, self.slots = cfg, slots or cfg.length
        most = cfg.learned_positions  # a learned position table ends there
        if self.slots < 1 or (most and self.slots > most):
            bound = f" and <= {most}, the model's learned positions" if most else ""
            raise ParameterError(f"max_length (--max-length) must be >= 1{bound}, got {self.slots}")
        if mesh is not None:  # one layout for several programs, some without batch
            layout = Layout(layout) if isinstance(layout, str) else (layout or Layout())
            layout = Layout(layout.rules, layout.strict, shared=True)
        build = jax.jit if mesh is None else (lambda f: lower(f, mesh, layout))
        n = self.slots
        # a prefill's cache holds the bucket past its prompts' width
        self._prefill = build(
            lambda p, t, i, e: prefill_step(p, t, i, cfg, bucket(t.size_of("length") + 1, n), e)
        )
        # one compiled step per cache size (`bucket`); the cache's buffers are donated, so
        # XLA writes the new position into them in place
        donate = jax.jit if mesh is None else (lambda f, **_: lower(f, mesh, layout))
        self._steps, self._grow = {}, {}
        self._step_of = lambda: donate(
            lambda p, t, i, c, e: decode_step(p, t, i, c, cfg, e), donate_argnums=3
        )
        self._grow_to = lambda size: build(lambda c: grown(c, size))
        # the step and the choice of its tokens in one program, per `how` (one device)
        self.mesh, self._picks = mesh, {}
        self._pick_of = lambda how: jax.jit(
            lambda p, t, i, c, e, k: _picked(decode_step(p, t, i, c, cfg, e), k, how),
            donate_argnums=3,
        )
        self._split = build(layer_caches)
        self._encode = build(lambda p, b: encode_memory(p, b, cfg))
        # each layer's parameters in buffers of their own, in the compute dtype, made once
        self.params = build(lambda p: unstacked(transformer.compute_params(p, cfg)))(params)
        self._choose = jax.jit(choose, static_argnums=2)
        self.encoded = None  # an encoder-decoder's (cross keys and values, bias): `encode`

    # --- the compiled pieces, on NumPy rows ------------------------------------------
    def step(self, tokens: np.ndarray, position, cache):
        """(log-probabilities (batch, vocab) as NumPy, new cache) after feeding `tokens`
        (batch,) at `position` (an int, or one per row)."""
        logits, cache = self.step_logits(tokens, position, cache)
        return np.asarray(jax.nn.log_softmax(logits, -1)), cache

    def step_logits(self, tokens: np.ndarray, position, cache):
        """(logits (batch, vocab) as a jax.Array, new cache): `step` without the
        log-softmax and the copy to the host. The cache (`layer_caches`' form;
        `init_cache`'s is split first) grows to the `bucket` of its longest row when
        that row reaches its end: a copy per bucket, not per step."""
        logits, cache = self._run(self._steps, self._step_of, tokens, position, cache)
        return logits.transpose("batch", "vocab").data, cache

    def step_tokens(self, tokens: np.ndarray, position, cache, draw, how: Sampling | None):
        """(the next tokens (batch,) as NumPy, new cache): `step_logits`, then `choose`
        with the key `draw` (None for greedy) and `how`; on one device in the step's
        compiled program (the decoding loop's step: one dispatch per token, not two)."""
        if self.mesh is not None:  # choose reads the whole vocab: after the lowered step
            logits, cache = self.step_logits(tokens, position, cache)
            return np.asarray(self._choose(logits, draw, how)), cache
        make = lambda: self._pick_of(how)
        tok, cache = self._run(self._picks.setdefault(how, {}), make, tokens, position, cache, draw)
        return np.asarray(tok), cache

    def _run(self, programs: dict, make, tokens, position, cache, *more):
        """A step's program of `programs` (one per cache size, made by `make`) on NumPy
        tokens and positions, after growing the cache to the longest row's bucket."""
        at = np.asarray(position)
        i = _ints(at, ("batch",) if at.ndim else ())
        t = _ints(np.asarray(tokens)[:, None], ("batch", "length"))
        self._check_encoded(len(t.data))
        cache = self._split(cache) if isinstance(cache, dict) else cache
        size = bucket(int(at.max()) + 1, self.slots)
        if size > cache_slots(cache):
            if size not in self._grow:
                self._grow[size] = self._grow_to(size)
            cache = self._grow[size](cache)
        size = cache_slots(cache)
        if size not in programs:
            programs[size] = make()
        return programs[size](self.params, t, i, cache, self.encoded, *more)

    def prefill_logits(self, rows: np.ndarray, lengths: np.ndarray):
        """(logits (batch, vocab) after each row's last real token as a jax.Array, the
        filled cache): one prefill pass over right-padded rows (batch, n) whose first
        `lengths` tokens are real."""
        last = _ints(np.asarray(lengths) - 1, ("batch",))
        self._check_encoded(len(rows))
        logits, cache = self._prefill(
            self.params, _ints(rows, ("batch", "length")), last, self.encoded
        )
        return logits.transpose("batch", "vocab").data, cache

    def prefill(self, rows: np.ndarray, lengths: np.ndarray | None = None):
        """(log-probs after each row's last token, cache, next position) for token rows
        (batch, n), n <= slots, in one forward pass; `lengths` (batch,): each row's real
        tokens, the rest padding (default: all n)."""
        rows = np.asarray(rows)
        n = rows.shape[1]
        lengths = np.full(len(rows), n) if lengths is None else np.asarray(lengths)
        wide = min(self.slots, -(-n // 8) * 8)  # widths share compiled prefills, as in pad_rows
        rows = np.pad(rows, ((0, 0), (0, wide - n)))
        logits, cache = self.prefill_logits(rows, lengths)
        return np.asarray(jax.nn.log_softmax(logits, -1)), cache, n

    def prefill_by_steps(self, rows: np.ndarray):
        """As `prefill` without padding, a token at a time through `step` (the way
        decoding prefilled before the one-pass prefill; the benchmark's baseline)."""
        rows = np.asarray(rows)
        cache = layer_caches(init_cache(self.cfg, rows.shape[0], bucket(1, self.slots)))
        for i in range(rows.shape[1]):
            logp, cache = self.step(rows[:, i], i, cache)
        return logp, cache, rows.shape[1]

    def _check_encoded(self, rows: int) -> None:
        """ParameterError unless an encoder-decoder has encoded as many inputs as the
        decoder has `rows` (an LM has no encoding)."""
        if self.encoded is None:
            if "encoder" in self.params:
                raise ParameterError(
                    "an encoder-decoder decodes after encode(inputs): call encode or translate"
                )
            return
        have = self.encoded[1].size_of("batch")
        if have != rows:
            raise ParameterError(
                f"the decoder has {rows} rows but encode was given {have} inputs: one row each"
            )

    def encode(self, inputs, weights: np.ndarray | None = None) -> None:
        """Encode an encoder-decoder's inputs once: token lists (right-padded here), or an
        array (batch, n) with `weights` (1 real, 0 padding). Every decoder layer's
        cross-attention keys and values of the encoding are computed here, once
        (`encode_memory`), and the following steps read them; decode as many rows as
        inputs."""
        if "encoder" not in self.params:
            raise ParameterError("encode: this model has no encoder (a decoder-only model)")
        if weights is None and not isinstance(inputs, np.ndarray):
            most = self.cfg.learned_positions or 2**31  # relative positions: no bound
            inputs, lengths = pad_rows(inputs, self.cfg.vocab, most)
            weights = np.arange(inputs.shape[1])[None, :] < lengths[:, None]
        inputs = np.asarray(inputs, np.int32)
        w = np.ones(inputs.shape, np.float32) if weights is None else weights
        batch = {
            "inputs": nm.tensor(inputs, ("batch", "length")),
            "input_weights": nm.tensor(np.asarray(w, np.float32), ("batch", "length")),
        }
        self.encoded = self._encode(self.params, batch)

    # --- decoding ----------------------------------------------------------------------
    def decode(
        self,
        prompts,
        max_new: int,
        *,
        sampling: Sampling | None = None,
        eos: int | Sequence[int] | None = None,
        max_length: int | None = None,
        on_step: Callable[[np.ndarray, np.ndarray], np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """New tokens (batch, steps) after a batch of prompts (token lists of any
        lengths; an encoder-decoder's decoder start after `encode`), one prefill pass
        then one step per token: the likeliest (greedy), or drawn as `sampling` says
        (temperature, top_k, top_p, seed: `Sampling(...)`). A row finishes at an end id
        (`eos`: one id or several, as Llama 3's folders list) or when it holds
        `max_length` tokens (prompt included; <= slots, default slots) and emits the
        first end id (0 without one) from then on; decoding ends after `max_new` steps
        or when every row has finished, so steps <= max_new. `on_step(tokens, live)`, if
        given, sees each step's tokens (batch,) as they are chosen, `live` marking the
        rows whose token is new (not a finished row's filler), and may return a boolean
        mask of rows to finish there (a stop string: models/inference/continuations.py); the
        compiled programs are the same with or without it."""
        how = _sampling(sampling)
        limit, ends = self._check(max_new, eos, max_length)
        rows, lengths = pad_rows(prompts, self.cfg.vocab, limit)
        logits, cache = self.prefill_logits(rows, lengths)
        key, fill = (how or Sampling()).key(), ends[0] if len(ends) else 0
        draw = lambda i: None if how is None else jax.random.fold_in(key, i)  # greedy: none
        tok = np.asarray(self._choose(logits, draw(0), how))
        count, done, out = lengths.copy(), lengths >= limit, []
        for i in range(max_new):
            if done.all():
                break
            tok = np.where(done, fill, tok)
            out.append(tok)
            live = ~done
            done = done | np.isin(tok, ends) | (count + 1 >= limit)
            if on_step is not None and (ended := on_step(tok, live)) is not None:
                done = done | ended
            if i + 1 < max_new and not done.all():  # finished rows rewrite their last slot
                at = np.minimum(count, limit - 1)
                tok, cache = self.step_tokens(tok, at, cache, draw(i + 1), how)
            count = np.where(done, count, count + 1)
        return np.stack(out, axis=1) if out else np.zeros((len(rows), 0), np.int32)

    def translate(self, inputs, max_new: int, start: int = 0, **kw) -> np.ndarray:
        """An encoder-decoder's new tokens (batch, steps) for a batch of input token
        lists: `encode` once, then `decode` from the decoder start token `start`."""
        self.encode(inputs)
        return self.decode([[start]] * len(inputs), max_new, **kw)

    def greedy_rows(self, rows: np.ndarray, max_new: int) -> np.ndarray:
        """The `max_new` likeliest-next tokens after each row of `rows` (batch, n), by
        batch: the decoder's start tokens of an encoder-decoder after `encode`."""
        return self.decode(list(np.asarray(rows)), max_new)

    def _check(self, max_new: int, eos, max_length: int | None) -> tuple[int, np.ndarray]:
        """The max length and the end ids after checking the decoding parameters
        (ParameterError)."""
        if not isinstance(max_new, int | np.integer) or max_new < 0:
            raise ParameterError(f"max_new (--max-new) must be an int >= 0, got {max_new!r}")
        ends = [] if eos is None else [eos] if np.ndim(eos) == 0 else list(eos)
        for e in ends:
            if not isinstance(e, int | np.integer) or isinstance(e, bool):
                raise ParameterError(f"eos (--eos) must be int token ids, got {eos!r}")
            if not 0 <= e < self.cfg.vocab:
                raise ParameterError(
                    f"eos (--eos) {e} is outside the vocabulary [0, {self.cfg.vocab})"
                )
        limit = self.slots if max_length is None else max_length
        if not 1 <= limit <= self.slots:
            raise ParameterError(
                f"max_length (--max-length) must be in [1, {self.slots}] (the cache's slots), "
                f"got {max_length!r}"
            )
        return limit, np.asarray(ends, np.int64)

    def generate(
        self,
        prompt: list[int],
        max_new: int,
        *,
        sampling: Sampling | None = None,
        beams: int | None = None,
        eos: int | Sequence[int] | None = None,
        on_step: Callable[[np.ndarray, np.ndarray], np.ndarray | None] | None = None,
    ) -> list[int]:
        """One prompt's continuation: `max_new` new tokens, the likeliest (greedy), drawn
        as `sampling` says, or the best of a beam search of width `beams`; fewer when an
        end id (`eos`, one or several) ends it (the end id included) or `on_step` (as in
        `decode`, on one row; not with beams) returns a true mask. A prompt longer than
        the cache is cut to its last `slots` tokens; past the cache's slots, the last half
        of the text is written into a fresh cache and decoding goes on (positions restart
        at 0, as in training)."""
        how = _sampling(sampling)
        if beams is not None and (how is not None or on_step is not None):
            raise ParameterError(
                f"beams={beams!r} search the likeliest continuations, whole: sampling (a "
                "draw) and on_step (a stop per token) do not go with them"
            )
        if not len(prompt):
            raise ParameterError("the prompt must hold at least one token")
        ends = self._check(max_new, eos, None)[1]
        if beams is not None:
            return self.beam(prompt, max_new, beams, ends)[0]
        key = (how or Sampling()).key()
        rows = np.asarray([prompt[-self.slots :]])
        logp, cache, pos = self.prefill(rows)
        out = []
        for i in range(max_new):
            out.append(int(self._choose(jnp.asarray(logp), jax.random.fold_in(key, i), how)[0]))
            ended = None if on_step is None else on_step(np.asarray(out[-1:]), np.ones(1, bool))
            if out[-1] in ends or (ended is not None and ended[0]):
                break
            rows = np.concatenate([rows, [[out[-1]]]], axis=1)
            logp, cache, pos = self._advance(rows, cache, pos)
        return out

    def _advance(self, rows: np.ndarray, cache: dict, pos: int):
        """Feed the last token of `rows`; refill a fresh cache when this one is full."""
        if pos == self.slots:
            return self.prefill(rows[:, -(self.slots // 2) :])
        logp, cache = self.step(rows[:, -1], pos, cache)
        return logp, cache, pos + 1

    def beam(
        self, prompt: list[int], max_new: int, beams: int, eos: Sequence[int] = ()
    ) -> tuple[list[int], float]:
        """(the best continuation, its log-probability) by beam search of width `beams`:
        of `max_new` tokens, or fewer, its last an end id of `eos`. A hypothesis ends at
        an end id: its one extension is that id again at log-probability 0 (its score
        stays), cut from the result; the search stops when every hypothesis has ended."""
        if not isinstance(beams, int) or beams < 1:
            raise ParameterError(f"beams (--beams) must be an int >= 1, got {beams!r}")
        ends = np.asarray(list(eos), np.int64)
        rows = np.asarray([prompt[-self.slots :]])
        logp, cache, pos = self.prefill(rows)
        seqs, scores = np.zeros((1, 0), int), np.zeros(1)
        one = self.encoded  # an encoder-decoder's input, one row for every hypothesis
        try:
            for _ in range(max_new):
                if seqs.shape[1]:  # an ended hypothesis goes on by its end id alone
                    ended = np.isin(seqs[:, -1], ends)
                    if ended.all():
                        break
                    logp = np.where(ended[:, None], _repeat(seqs[:, -1], logp.shape[1]), logp)
                total = scores[:, None] + logp  # (beams, vocab)
                best = np.argsort(-total, axis=None, kind="stable")[:beams]
                parent, tok = np.unravel_index(best, total.shape)
                seqs = np.concatenate([seqs[parent], tok[:, None]], axis=1)
                scores = total[parent, tok]
                cache = tuple({k: _rows(v, parent) for k, v in c.items()} for c in cache)
                rows = np.concatenate([rows[np.minimum(parent, len(rows) - 1)], tok[:, None]], 1)
                self.encoded = None if one is None else _widen(one, len(parent))
                logp, cache, pos = self._advance(rows, cache, pos)
        finally:
            self.encoded = one
        seq = [int(t) for t in seqs[0]]
        stop = next((i for i, t in enumerate(seq) if t in ends), len(seq) - 1)
        return seq[: stop + 1], float(scores[0])


def _repeat(last: np.ndarray, vocab: int) -> np.ndarray:
    """Log-probabilities (rows, vocab) that extend each row only by its `last` token."""
    return np.where(np.arange(vocab)[None, :] == last[:, None], 0.0, -np.inf)


def _sampling(sampling) -> Sampling | None:
    """`sampling` checked: a Sampling, or None for greedy; ParameterError for anything
    else (the mode string that decode and generate once took before it)."""
    if sampling is None or isinstance(sampling, Sampling):
        return sampling
    raise ParameterError(
        f"sampling must be a models.inference.sampling.Sampling (or None: greedy), got {sampling!r}"
    )


def _rows(t: nm.Tensor, index: np.ndarray) -> nm.Tensor:
    """The batch rows `index` of t (a beam's parent hypotheses)."""
    axis = t.dims.index("batch")
    return nm.tensor(jnp.take(t.data, jnp.asarray(index), axis=axis), t.dims)
