"""Batched sampling on the device: per-row settings as arrays (`SamplingArrays`) and `sample`.

`SamplingArrays.from_params` packs a step's requests into per-row numpy arrays padded to a bucket
size; padding rows are greedy and neutral. `sample` is a pure, jit-friendly function of arrays only
(no Python branching on values). Per row, in this order:

1. penalties on the raw logits: repetition (HF/vLLM: a logit of a token seen in the prompt or
   the output is divided by the penalty when positive, multiplied when negative), then
   frequency and presence (OpenAI: ``logit -= count * frequency + (count > 0) * presence``,
   counts over generated tokens only);
2. greedy rows (temperature == 0) take the argmax of the penalised logits (ties -> lowest id);
3. other rows: one stable descending sort of the penalised logits, then temperature, top-k,
   top-p (the smallest prefix of most probable tokens whose probability mass reaches top_p,
   measured after top-k; the top token is always kept), min-p (drop tokens whose probability is
   below ``min_p * max_prob``), and a draw with `jax.random.categorical` over what remains; the
   sorted position is mapped back to a token id through the sort permutation. The host knows each
   row's parameters and may pick a sampler without the sort (choose.py's `sampler_for`): "plain"
   where no row uses top-k or top-p (min-p is a threshold on the tempered logits), "filter" where
   every row using top-k has one of at most TOP_K_CANDIDATES (its survivors are among that many
   largest logits, which a top-k finds without sorting the vocabulary; top-p then runs on them),
   and "filter-p" where rows using top-p alone join those: they find the nucleus's boundary by a
   radix search over the logits' bits (`_top_p_keep`). The draw adds the same noise by token id in
   every sampler, so they pick the same token.

The randomness of row b is ``fold_in(key(seed[b]), step_index[b])``, so a request's tokens do
not depend on which other requests share the batch nor on the row it sits in.

The returned logprob is that of the chosen token under the raw model distribution
(``log_softmax`` of the unpenalised, untempered logits), as vLLM returns by default.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling.params import SamplingParams, check_int, is_int, seed_to_u32

TOP_K_CANDIDATES = 64   # the largest top-k the "filter" sampler takes (Qwen3's recommended: 20; llama.cpp's: 40)


@flax.struct.dataclass
class SamplingArrays:
    """Per-row sampling settings of one step, each of shape [B]."""

    temperature: jax.Array  # f32; 0 = greedy
    top_k: jax.Array  # i32; 0 = off
    top_p: jax.Array  # f32; 1 = off
    min_p: jax.Array  # f32; 0 = off
    repetition_penalty: jax.Array  # f32; 1 = off
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    seed: jax.Array  # uint32

    @staticmethod
    def from_params(params: Sequence[SamplingParams], seeds: Sequence[int], pad_to: int) -> "SamplingArrays":
        """Pack ``params`` (one per row) into numpy arrays of length ``pad_to``.

        ``seeds[i]`` is row i's seed (the engine draws one when the request gave none); it is
        reduced to its low 32 bits. Rows past ``len(params)`` are greedy with neutral penalties.
        """
        n = len(params)
        if len(seeds) != n:
            raise ValueError(f"seeds must have one entry per params row ({n}), got {len(seeds)}")
        if not is_int(pad_to) or pad_to < n:
            raise ValueError(f"pad_to must be an int >= len(params) ({n}), got {pad_to!r}")

        def col(values, pad, dtype):
            a = np.full((pad_to,), pad, dtype=dtype)
            if n:
                a[:n] = np.asarray(values, dtype=dtype)
            return a

        for s in seeds:
            check_int("seed", s)
        return SamplingArrays(
            temperature=col([p.temperature for p in params], 0.0, np.float32),
            top_k=col([max(p.top_k, 0) for p in params], 0, np.int32),
            top_p=col([p.top_p for p in params], 1.0, np.float32),
            min_p=col([p.min_p for p in params], 0.0, np.float32),
            repetition_penalty=col([p.repetition_penalty for p in params], 1.0, np.float32),
            presence_penalty=col([p.presence_penalty for p in params], 0.0, np.float32),
            frequency_penalty=col([p.frequency_penalty for p in params], 0.0, np.float32),
            seed=col([seed_to_u32(s) for s in seeds], 0, np.uint32),
        )


def apply_penalties(
    logits: jax.Array, arrays: SamplingArrays, prompt_mask: jax.Array, output_counts: jax.Array
) -> jax.Array:
    """Repetition (prompt + output, HF/vLLM), then frequency and presence (output, OpenAI)."""
    rep = arrays.repetition_penalty[:, None].astype(jnp.float32)
    seen = prompt_mask | (output_counts > 0)
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    counts = output_counts.astype(jnp.float32)
    logits = logits - arrays.frequency_penalty[:, None] * counts
    logits = logits - arrays.presence_penalty[:, None] * (output_counts > 0).astype(jnp.float32)
    return logits


def _row_keys(seed: jax.Array, step_index: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed[b]), step_index[b])."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(
        seed.astype(jnp.uint32), step_index.astype(jnp.int32)
    )


def gumbel_noise(seed: jax.Array, step_index: jax.Array, vocab: int) -> jax.Array:
    """The Gumbel noise `sample` adds to row b's kept logits, by token id: [B, vocab] f32, row b drawn
    from fold_in(key(seed[b]), step_index[b])."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab,)))(_row_keys(seed, step_index))


def _tempered(logits: jax.Array, row_max: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """(logits - row_max [B, 1]) / temperature (1 for greedy rows). Shifting by the max before dividing
    keeps a tiny temperature from overflowing to +inf: the top entry is exactly 0, the rest <= 0."""
    temp = arrays.temperature.astype(jnp.float32)
    return (logits - row_max) / jnp.where(temp > 0, temp, 1.0)[:, None]


def _min_p_keep(scaled: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """min-p on tempered logits: p_i >= min_p * p_max  <=>  exp(scaled_i) >= min_p (scaled_max == 0)."""
    return jnp.exp(scaled) >= arrays.min_p.astype(jnp.float32)[:, None]


def _filtered_sorted_logits(sorted_logits: jax.Array, row_max: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Temperature, top-k, top-p, min-p on logits sorted descending (row_max [B, 1]: their first entry);
    dropped entries -> -inf."""
    V = sorted_logits.shape[-1]
    scaled = _tempered(sorted_logits, row_max, arrays)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]

    # top-k
    k = arrays.top_k.astype(jnp.int32)[:, None]
    keep = (k <= 0) | (rank < k)

    # top-p over the top-k survivors, renormalised
    e = jnp.where(keep, jnp.exp(scaled), 0.0)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix sum
    top_p = arrays.top_p.astype(jnp.float32)[:, None]
    keep &= (top_p >= 1.0) | (mass_before < top_p)

    keep &= _min_p_keep(scaled, arrays)

    keep |= rank == 0  # the most probable token always survives
    return jnp.where(keep, scaled, -jnp.inf)


def filtered_logits(penalised: jax.Array, arrays: SamplingArrays, method: str = "branch") -> jax.Array:
    """The tempered logits a sampled row draws from, by token id: ``(penalised - row max) / temperature``
    where temperature, top-k, top-p and min-p keep the token, -inf where they drop it. A row's softmax is
    the distribution `sample` draws from when the row's temperature is > 0 (a greedy row comes out at
    temperature 1 with its filters applied; the caller handles greedy rows).

    Every filter keeps a prefix of the sorted order (descending, ties by lower id) and the top token, so
    the kept tokens are those at or above the last kept one (value, then id): the filters run on the
    sorted logits as in `sample` and map back by that comparison, without a scatter. ``method`` (static)
    as `sample`'s, for the rows `sampler_for` gives each: "branch" sorts behind a device-side conditional
    that skips the sort when no sampled row uses top-k or top-p; "sort" always sorts; "plain" applies
    min-p alone (a threshold on the tempered logits); "filter" runs the filters of rows with a top-k on
    their TOP_K_CANDIDATES largest logits; "filter-p" also keeps top-p-alone rows' nucleus by the radix
    search."""
    B, V = penalised.shape
    penalised = penalised + 0.0   # no -0.0: equal logits compare equal in the sorts' total order
    scaled = _tempered(penalised, jnp.max(penalised, axis=-1, keepdims=True), arrays)
    ids = jax.lax.broadcasted_iota(jnp.int32, (B, V), 1)

    def keep_prefix(values: jax.Array, value_ids: jax.Array) -> jax.Array:
        """The filters on candidates sorted descending (values, value_ids [B, C]), as a mask over the vocabulary."""
        masked = _filtered_sorted_logits(values, jnp.max(values, axis=-1, keepdims=True), arrays)
        last = jnp.maximum(jnp.sum(masked > -jnp.inf, axis=-1, keepdims=True), 1) - 1     # [B, 1]
        cut_value = jnp.take_along_axis(values, last, axis=-1)
        cut_id = jnp.take_along_axis(value_ids, last, axis=-1)
        return (penalised > cut_value) | ((penalised == cut_value) & (ids <= cut_id))

    def sorted_keep() -> jax.Array:
        neg_sorted, sorted_ids = jax.lax.sort((-penalised, ids), dimension=-1, is_stable=True, num_keys=1)
        return keep_prefix(-neg_sorted, sorted_ids)

    keep = _min_p_keep(scaled, arrays)   # the top token always passes: exp(0) = 1 >= min_p
    if method == "branch":
        needs_sort = jnp.any((arrays.temperature > 0) & ((arrays.top_k > 0) | (arrays.top_p < 1.0)))
        keep &= jax.lax.cond(needs_sort, sorted_keep, lambda: jnp.ones((B, V), bool))
    elif method == "sort":
        keep &= sorted_keep()
    elif method in ("filter", "filter-p"):
        if method == "filter-p":   # rows with top-p and no top-k
            keep &= (arrays.top_p[:, None] >= 1.0) | _top_p_keep(scaled, arrays.top_p.astype(jnp.float32))
        values, value_ids = top_k_by_blocks(penalised, min(TOP_K_CANDIDATES, V))
        keep = jnp.where(arrays.top_k[:, None] > 0, keep_prefix(values, value_ids), keep)
    elif method != "plain":
        raise ValueError(f"unknown sampling method {method!r}")
    return jnp.where(keep, scaled, -jnp.inf)


def sample(
    logits: jax.Array,
    arrays: SamplingArrays,
    step_index: jax.Array,
    prompt_mask: jax.Array,
    output_counts: jax.Array,
    greedy_only: bool = False,
    method: str = "branch",
    bitmask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    logits [B, V] f32; step_index [B] i32 (index of the token being generated, 0 for the first);
    prompt_mask [B, V] bool; output_counts [B, V] i32. Returns (tokens [B] i32, logprob [B] f32),
    the logprob being that of the token under log_softmax of the raw ``logits``. ``greedy_only``
    (static) compiles the argmax alone, for batches the caller knows are all greedy. ``method`` (static):
    "branch" sorts the vocabulary behind a device-side conditional that skips it when every row is
    greedy (the GPU runtime reads its predicate back mid-call); "sort" sorts whenever called, with no
    conditional; "plain", "filter" and "filter-p" do not sort, for the batches `sampler_for` gives them. The tokens
    are the same whichever applies (the Gumbel noise of a row is drawn per token id, so the draw does not
    depend on the order it is taken in; they could differ only at exact ties or at a top-p boundary
    within float rounding). ``bitmask`` [B, ceil(V / 32)] int32 (structured output): the tokens whose bit
    is 0 are dropped (after the penalties; the returned logprobs stay the model's); None compiles no mask.
    """
    logits = logits.astype(jnp.float32)
    penalised = apply_penalties(logits, arrays, prompt_mask, output_counts)
    if bitmask is not None:
        penalised = apply_bitmask(penalised, bitmask)
    if greedy_only:
        return greedy_with_logprob(logits, penalised)

    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy_tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)

    B, V = penalised.shape
    # Gumbel-max: the argmax of the kept tempered logits plus Gumbel noise is a draw from their softmax
    # (jax.random.categorical). The noise is drawn per token id, whichever order the logits are in.
    def noise() -> jax.Array:
        return gumbel_noise(arrays.seed, step_index, V)

    def sampled() -> jax.Array:
        # One stable descending sort per row: ties keep the lower token id first.
        ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
        # (+ 0.0 turns -0.0 into +0.0 so that equal logits compare equal in the sort's total order.)
        neg_sorted, sorted_ids = jax.lax.sort((-penalised + 0.0, ids), dimension=-1, is_stable=True, num_keys=1)
        masked = _filtered_sorted_logits(-neg_sorted, -neg_sorted[:, :1], arrays)
        pos = jnp.argmax(masked + jnp.take_along_axis(noise(), sorted_ids, axis=-1), axis=-1)
        return jnp.take_along_axis(sorted_ids, pos[:, None].astype(jnp.int32), axis=-1)[:, 0]

    def unsorted() -> jax.Array:
        # rows without top-k and top-p: _filtered_sorted_logits' masks (temperature, min-p) without the order
        scaled = _tempered(penalised, jnp.max(penalised, axis=-1, keepdims=True), arrays)
        keep = _min_p_keep(scaled, arrays)
        if method == "filter-p":   # rows with top-p and no top-k
            keep &= (arrays.top_p[:, None] >= 1.0) | _top_p_keep(scaled, arrays.top_p.astype(jnp.float32))
        g = noise()
        tokens = jnp.argmax(jnp.where(keep, scaled, -jnp.inf) + g, axis=-1)
        if method in ("filter", "filter-p"):
            # rows with top-k <= TOP_K_CANDIDATES (and any top-p, min-p): the filters on that many largest
            # logits, in the sort's order (descending, ties by lower id), are those on the sorted vocabulary
            values, ids = top_k_by_blocks(penalised + 0.0, min(TOP_K_CANDIDATES, V))
            # the row's max, not values[:, :1] (the same value): a slice of a top-k's output keeps XLA from
            # rewriting sort + slice into a top-k, and the top-64 of the 8,192 candidates becomes a full sort
            masked = _filtered_sorted_logits(values, jnp.max(values, axis=-1, keepdims=True), arrays)
            pos = jnp.argmax(masked + jnp.take_along_axis(g, ids, axis=-1), axis=-1)
            tokens = jnp.where(arrays.top_k > 0, jnp.take_along_axis(ids, pos[:, None], axis=-1)[:, 0], tokens)
        return tokens

    if method not in ("branch", "sort", "plain", "filter", "filter-p"):
        raise ValueError(f"unknown sampling method {method!r}")
    if method in ("plain", "filter", "filter-p"):
        sampled_tokens = unsorted()
    elif method == "branch":
        # A batch of greedy rows skips the sort over the vocabulary (the costly part at V = 152k). The
        # predicate lives on the device, so the GPU runtime reads it back to pick the branch.
        sampled_tokens = jax.lax.cond(jnp.any(arrays.temperature > 0), sampled, lambda: greedy_tokens)
    else:
        sampled_tokens = sampled()
    tokens = jnp.where(arrays.temperature == 0, greedy_tokens, sampled_tokens).astype(jnp.int32)
    logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprob


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """logits [B, V] with -inf where bitmask [B, ceil(V / 32)] int32 has a 0 bit (bit j of word i: token
    32 i + j; llguidance's layout). A row of all ones (an unconstrained request's) leaves its logits as they are."""
    B, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(bitmask[:, :, None], shifts[None, None, :]) & 1    # arithmetic shift: bit 31 too
    allowed = bits.reshape(B, -1)[:, :V] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def greedy_with_logprob(logits: jax.Array, penalised: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(argmax of penalised [B, V], as jnp.argmax picks it: the first of equal values, NaN above all; the
    token's logprob under log_softmax of the raw logits [B, V]) in two passes over the vocabulary.

    Pass 1 is one variadic reduction: the argmax (value, index, the raw logit there) and the raw logits'
    max; pass 2 sums exp(logit - max), as log_softmax does. jnp.argmax, log_softmax and a gather compile to
    seven kernels on a GPU (two stages each for the max, the sum and the argmax, then the log); this takes
    two reductions. (An online log-sum-exp in pass 1 would make it one, but summed element after element it was
    2e-4 off in float32 at V = 152k on the CPU.)"""
    B, V = penalised.shape
    f32 = jnp.float32
    ids = jax.lax.broadcasted_iota(jnp.int32, (B, V), 1)

    def combine(a, b):
        va, ia, ra, ma = a
        vb, ib, rb, mb = b
        a_nan, b_nan = jnp.isnan(va), jnp.isnan(vb)
        tie = (va == vb) | (a_nan & b_nan)
        take_a = (va > vb) | (a_nan & ~b_nan) | (tie & (ia < ib))
        return jnp.where(take_a, va, vb), jnp.where(take_a, ia, ib), jnp.where(take_a, ra, rb), jnp.maximum(ma, mb)

    init = (f32(-jnp.inf), jnp.int32(jnp.iinfo(jnp.int32).max), f32(0), f32(-jnp.inf))
    _, token, raw_at, m = jax.lax.reduce((penalised, ids, logits, logits), init, combine, (1,))
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)   # as log_softmax shifts: a row of -inf stays -inf, not NaN
    total = jnp.sum(jnp.exp(logits - m_safe[:, None]), axis=-1)
    return token, raw_at - m_safe - jnp.log(total)


def _top_p_keep(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-p over whole rows of tempered logits scaled [B, V] (max 0) without sorting them: the tokens the
    sorted path keeps (mass before them in the order descending, ties by lower id, below top_p [B]).
    The last token kept has the largest value t with mass(logits >= t) >= top_p. Eight passes find t's
    32 bits four at a time (16 candidate thresholds per pass, each a masked sum over the row), on keys
    whose unsigned order is the floats' order; then ties at t are kept by id while the mass stays below.
    The masked sums are laid out [B, V, 16] and reduced over V: laid out [B, 16, V] they were slower on
    the GPU."""
    bits = jax.lax.bitcast_convert_type(scaled + 0.0, jnp.uint32)          # + 0.0: no -0.0
    key = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))
    e = jnp.exp(scaled)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    p = top_p[:, None]
    prefix = jnp.zeros(scaled.shape[:1], jnp.uint32)
    digits = jnp.arange(16, dtype=jnp.uint32)
    for shift in range(28, -4, -4):
        thresholds = prefix[:, None] | (digits[None, :] << shift)                                 # [B, 16]
        mass = jnp.sum(jnp.where(key[:, :, None] >= thresholds[:, None, :], probs[:, :, None], 0.0), axis=1)
        digit = jnp.maximum(jnp.sum(mass >= p, axis=-1) - 1, 0)      # the largest digit whose mass reaches p
        prefix = prefix | (digit.astype(jnp.uint32) << shift)
    t = prefix[:, None]
    above = jnp.sum(jnp.where(key > t, probs, 0.0), axis=-1, keepdims=True)
    tie = jnp.where(key == t, probs, 0.0)
    return (key > t) | ((key == t) & (above + jnp.cumsum(tie, axis=-1) - tie < p))


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest entries of log_softmax(raw logits) per row: (values [B, k] f32, ids [B, k] i32).

    ``k`` must be static (a Python int); ties list the lower id first.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    B = logp.shape[0]
    if k == 0:
        return jnp.zeros((B, 0), jnp.float32), jnp.zeros((B, 0), jnp.int32)
    values, ids = top_k_by_blocks(logp, k)
    return values, ids.astype(jnp.int32)


def top_k_by_blocks(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` over the last axis of x [B, V], ties included (lower index first),
    without a top-k over all V: the rows are cut into blocks of `block`, the k blocks with the
    largest maxima are kept (fewer than k entries beat the k-th value, so every block holding a
    winner is among them; ties pick the lower block, as they pick the lower index) and the top-k of
    those k x block candidates, in index order, is the answer. One pass over x plus two small
    top-ks, where XLA's top-k over all of a 152k-entry row is slow on the GPU."""
    B, V = x.shape
    n = -(-V // block)
    if n <= 2 * k:                         # the blocks would not cut much
        return jax.lax.top_k(x, k)
    xp = jnp.pad(x, ((0, 0), (0, n * block - V)), constant_values=-jnp.inf).reshape(B, n, block)
    _, best = jax.lax.top_k(jnp.max(xp, axis=-1), k)                        # [B, k] block indices
    best = jnp.sort(best, axis=-1)                                          # candidates in index order
    cand = jnp.take_along_axis(xp, best[:, :, None], axis=1).reshape(B, k * block)
    values, pos = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(best, pos // block, axis=-1) * block + pos % block
    return values, ids
