"""Speculative decoding's acceptance on the device: which drafted tokens a verify step keeps.

A verify step runs the target model over a sequence's committed text plus its drafts d_0..d_{n-1}
and gets Q = n_max + 1 rows of logits per sequence: row j is the target's next-token logits after
d_0..d_{j-1}. `verify` turns them into the tokens to commit, lossless with respect to `sample`:

- row j's target distribution p_j is what `sample` would draw from at step ``step_index + j`` with
  the drafts before it counted as output (`target_probs`: penalties, temperature, top-k, top-p,
  min-p; one-hot at the argmax for greedy rows);
- drafts are accepted by speculative (rejection) sampling (Leviathan et al. 2023, Chen et al. 2023):
  d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection a token from
  normalize(max(p_j - q_j, 0)); after n acceptances a bonus token from p_n.

Without draft probabilities (n-gram drafts: q_j is one-hot at d_j) the draw is coupled to `sample`'s:
row j takes the token `sample` would take there, with the same Gumbel noise (keyed by
fold_in(key(seed), step_index + j)), and d_j is accepted iff it is that token. That accepts d_j with
probability p_j(d_j) and, on rejection, leaves a draw from p_j without d_j, which is
normalize(max(p_j - onehot(d_j), 0)): the rule above, and the committed text is token for token what
plain sampling with the same seed gives, whatever the drafts. Greedy rows follow the same rule with
the argmax. With draft probabilities, the acceptance uniform comes from a key derived from the row's
(``fold_in(row key, 2**32 - 1)``, a counter the row's V noise draws do not use) and the residual's
draw reuses the row's Gumbel noise (a row's noise draws either the residual or the bonus, not both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.sampling.sample import (
    SamplingArrays,
    apply_bitmask,
    apply_penalties,
    filtered_logits,
    greedy_with_logprob,
    gumbel_noise,
)

METHODS = ("branch", "sort", "plain", "filter", "filter-p")   # sample's
_UNIFORM_FOLD = 0xFFFFFFFF  # folded into a row's key for its acceptance uniform (see the module docstring)


def _target_logits(penalised: jax.Array, arrays: SamplingArrays, method: str) -> jax.Array:
    """Logits [N, V] whose softmax is each row's target distribution: the kept tempered logits (-inf
    where dropped) for sampled rows, 0 at the argmax and -inf elsewhere for greedy rows."""
    ids = jax.lax.broadcasted_iota(jnp.int32, penalised.shape, 1)
    greedy_tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)[:, None]
    one_hot = jnp.where(ids == greedy_tokens, 0.0, -jnp.inf)
    return jnp.where((arrays.temperature == 0)[:, None], one_hot, filtered_logits(penalised, arrays, method))


def target_probs(
    logits: jax.Array,
    arrays: SamplingArrays,
    prompt_mask: jax.Array,
    output_counts: jax.Array,
    method: str = "branch",
) -> jax.Array:
    """The distribution `sample` draws each row from: [N, V] f32.

    logits [N, V] f32, arrays [N], prompt_mask [N, V] bool, output_counts [N, V] i32. Penalties on the
    raw logits, then temperature, top-k, top-p, min-p (the top token always kept); greedy rows
    (temperature 0) are one-hot at the argmax of the penalised logits (ties -> lowest id). ``method``
    (static): `sample`'s, for the rows `sampler_for` gives it.
    """
    penalised = apply_penalties(logits.astype(jnp.float32), arrays, prompt_mask, output_counts)
    return jax.nn.softmax(_target_logits(penalised, arrays, method), axis=-1)


def _check_shapes(logits, drafts, num_drafts, arrays, step_index, prompt_mask, output_counts, draft_probs,
                  bitmask=None):
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, Q, V], got shape {logits.shape}")
    B, Q, V = logits.shape
    expected = {
        "drafts": (drafts, (B, Q - 1)),
        "num_drafts": (num_drafts, (B,)),
        "step_index": (step_index, (B,)),
        "prompt_mask": (prompt_mask, (B, V)),
        "output_counts": (output_counts, (B, V)),
        "arrays.seed": (arrays.seed, (B,)),
        "arrays.temperature": (arrays.temperature, (B,)),
    }
    if draft_probs is not None:
        expected["draft_probs"] = (draft_probs, (B, Q - 1, V))
    if bitmask is not None:
        expected["bitmask"] = (bitmask, (B, Q, -(-V // 32)))
    for name, (x, shape) in expected.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for logits of shape {(B, Q, V)}, got {tuple(x.shape)}")


def verify(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    arrays: SamplingArrays,
    step_index: jax.Array,
    prompt_mask: jax.Array,
    output_counts: jax.Array,
    draft_probs: jax.Array | None = None,
    greedy_only: bool = False,
    method: str = "branch",
    bitmask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept or reject each sequence's drafts: (num_accepted [B] i32, tokens [B, Q] i32, logprobs [B, Q] f32).

    logits [B, Q, V] f32: row j is the target's logits after drafts[b, :j]. drafts [B, Q-1] i32, of
    which the first num_drafts[b] (0..Q-1; clipped) count, the rest being padding. arrays [B];
    step_index [B] i32: the index of the token row 0 generates; prompt_mask [B, V] bool; output_counts
    [B, V] i32: counts of the committed output (row j adds drafts[b, :j]). draft_probs [B, Q-1, V] f32:
    the draft model's distribution q_j each draft was drawn from, or None for one-hot drafts.
    ``greedy_only`` (static): the argmax alone, no sort and no noise, for batches of greedy rows only.
    ``method`` (static): `sample`'s ("branch", "sort", "plain", "filter", "filter-p"), for the rows
    `sampler_for` gives it; it picks how the filters find their kept tokens, not which.
    bitmask [B, Q, ceil(V / 32)] int32 (structured output): row j's allowed tokens (the grammar after
    drafts[b, :j]), applied after the penalties as `sample` applies its bitmask, so that a row's target is the
    masked, renormalised distribution (greedy: the argmax among the allowed tokens).

    With a = num_accepted[b]: tokens[b, :a] are the accepted drafts, tokens[b, a] the correction (or the
    bonus when a == num_drafts[b]); tokens[b, a+1:] are 0. logprobs[b, j] is log_softmax of the raw
    logits at row j at tokens[b, j] (as `sample` returns), 0 past a.
    """
    _check_shapes(logits, drafts, num_drafts, arrays, step_index, prompt_mask, output_counts, draft_probs, bitmask)
    if method not in METHODS:
        raise ValueError(f"unknown sampling method {method!r}; one of {METHODS}")
    B, Q, V = logits.shape
    N = B * Q
    f32, i32 = jnp.float32, jnp.int32
    drafts = drafts.astype(i32)
    n_drafts = jnp.clip(num_drafts.astype(i32), 0, Q - 1)
    is_draft = jnp.arange(Q - 1, dtype=i32)[None, :] < n_drafts[:, None]                  # [B, Q-1]

    # Output counts of row j: the committed ones plus drafts[:j] (only real drafts; out-of-range ids dropped).
    b_idx, j_idx, i_idx = jnp.meshgrid(jnp.arange(B), jnp.arange(Q), jnp.arange(Q - 1), indexing="ij")
    in_vocab = is_draft & (drafts >= 0) & (drafts < V)
    added = ((i_idx < j_idx) & in_vocab[:, None, :]).astype(i32)                           # [B, Q, Q-1]
    counts = jnp.broadcast_to(output_counts.astype(i32)[:, None, :], (B, Q, V))
    counts = counts.at[b_idx, j_idx, jnp.clip(drafts, 0, V - 1)[:, None, :]].add(added)

    rows = lambda x: jnp.repeat(x, Q, axis=0)                                              # [B, ...] -> [N, ...]
    row_arrays = jax.tree.map(rows, arrays)
    row_step = (step_index.astype(i32)[:, None] + jnp.arange(Q, dtype=i32)[None, :]).reshape(N)
    flat = logits.astype(f32).reshape(N, V)
    penalised = apply_penalties(flat, row_arrays, rows(prompt_mask), counts.reshape(N, V))
    if bitmask is not None:
        penalised = apply_bitmask(penalised, bitmask.reshape(N, -1))

    if greedy_only:
        picked, picked_logprob = greedy_with_logprob(flat, penalised)
        picked = picked.reshape(B, Q)
        accept = (drafts == picked[:, :-1]) & is_draft
        emit = picked
    else:
        greedy = (arrays.temperature == 0)[:, None]                                        # [B, 1]
        target = _target_logits(penalised, row_arrays, method)                             # [N, V]
        noise = gumbel_noise(row_arrays.seed, row_step, V)
        # the token `sample` takes at each row (the same noise by token id; greedy rows: the argmax)
        picked = jnp.argmax(target + noise, axis=-1).astype(i32).reshape(B, Q)
        picked = jnp.where(greedy, jnp.argmax(penalised, axis=-1).astype(i32).reshape(B, Q), picked)
        if draft_probs is None:
            accept = (drafts == picked[:, :-1]) & is_draft
            emit = picked
        else:
            target = target.reshape(B, Q, V)[:, :-1]                                       # rows with a draft
            p = jnp.exp(target - jax.nn.logsumexp(target, axis=-1, keepdims=True))         # [B, Q-1, V]
            q = draft_probs.astype(f32)
            d = jnp.clip(drafts, 0, V - 1)[:, :, None]
            p_d = jnp.take_along_axis(p, d, axis=-1)[:, :, 0]
            q_d = jnp.take_along_axis(q, d, axis=-1)[:, :, 0]
            keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), _UNIFORM_FOLD))(
                row_arrays.seed.astype(jnp.uint32), row_step)
            u = jax.vmap(lambda k: jax.random.uniform(k, (), f32))(keys).reshape(B, Q)[:, :-1]
            # accept with probability min(1, p/q): u < p/q, written without dividing (q may be 0)
            accept = jnp.where(greedy, drafts == picked[:, :-1], u * q_d < p_d) & is_draft
            residual = jnp.maximum(p - q, 0.0)
            residual_logits = jnp.where(residual > 0, jnp.log(jnp.where(residual > 0, residual, 1.0)), -jnp.inf)
            corrected = jnp.argmax(residual_logits + noise.reshape(B, Q, V)[:, :-1], axis=-1).astype(i32)
            # p == q up to rounding leaves no residual (a rejection there has probability ~0): draw from p
            corrected = jnp.where(greedy | ~jnp.any(residual > 0, axis=-1), picked[:, :-1], corrected)
            # row j < num_drafts emits only on rejection (the residual), row num_drafts the bonus (from p)
            emit = jnp.concatenate([jnp.where(is_draft, corrected, picked[:, :-1]), picked[:, -1:]], axis=1)
        picked_logprob = None

    num_accepted = jnp.sum(jnp.cumprod(accept.astype(i32), axis=1), axis=1).astype(i32)    # [B]
    pos = jnp.arange(Q, dtype=i32)[None, :]
    a = num_accepted[:, None]
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((B, 1), i32)], axis=1)
    tokens = jnp.where(pos < a, padded_drafts, jnp.where(pos == a, emit, 0)).astype(i32)
    if picked_logprob is not None:   # greedy: every committed token is its row's argmax
        logprobs = picked_logprob.reshape(B, Q)
    else:
        raw_logprobs = jax.nn.log_softmax(flat, axis=-1)
        logprobs = jnp.take_along_axis(raw_logprobs, tokens.reshape(N, 1), axis=-1).reshape(B, Q)
    logprobs = jnp.where(pos <= a, logprobs, 0.0)
    return num_accepted, tokens, logprobs
