"""RoPE beyond one table of full-width frequencies: partial rotary dims, LongRoPE, a second base for some layers.

Partial rotary (Phi-4-mini rotates 3/4 of each head): transformers rotates the first `rotary_dim` dims in
rotate-half pairs (i, i + rotary_dim / 2) and passes the rest. We order each head's q and k rows at load time
(`head_row_order`) so that the rotated pairs sit at (i, i + head_dim / 2) and the passing dims fill the rest of
each half, with frequency 0 there (cos 1, sin 0): every RoPE op and kernel then runs unchanged, and the scores
are the same sums in another order (q and k are ordered alike; v and the output are not touched).

LongRoPE (Phi-3): transformers takes the short factors while a forward's sequence is at most
original_max_position_embeddings long and the long ones past it: its generate takes the long ones for every token
of a prompt longer than that (one forward over the whole prompt), and for every token after it. The engine's
steps carry each sequence's choice (StepBatch.rope_long: its prompt is longer than that length,
`takes_long_factors`): such a sequence's tokens all take the long factors, its chunks that end before that length
included; another's take them past that length, each token by its own position, as its decode steps do (so a
recompute after a preemption, and a verify step's drafts, give the keys that plain decoding gives). A step without
rope_long (prompt_logits, tests) takes them for a sequence whose last position in the step is past that length, as
one forward over its tokens. The prefix cache keys a long prompt's blocks apart (engine/scheduler.py), so that
no sequence takes pages computed with the other factors. One case differs from transformers' generate, which the
goldens do not reach: a sequence whose prompt is within that length and that crosses it while decoding keeps its
earlier keys with the short factors (as vLLM does); transformers' Phi-3 drops its cache there and recomputes every
key with the long ones.

A second base (Gemma 3's sliding-window layers): both tables are computed once a step and each layer picks its own.
"""

from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig

Tables = tuple[jax.Array, jax.Array]


def head_row_order(cfg: ModelConfig) -> np.ndarray | None:
    """The order of one head's q/k dims (new dim j reads transformers' dim order[j]) that puts the rotated
    pairs at (i, i + head_dim / 2); None without a partial rotary factor."""
    hd, rd = cfg.head_dim, cfg.rotary_dim
    if rd == hd:
        return None
    half, r = hd // 2, rd // 2
    passing = np.arange(rd, hd)
    return np.concatenate([np.arange(r), passing[:half - r], np.arange(r, rd), passing[half - r:]])


def qk_rows(cfg: ModelConfig, rows: int, q_rows: bool, fused: bool) -> np.ndarray | None:
    """The row order of a projection's q or k part (or of a fused q/k/v one: fused) with `rows` rows (or
    entries: a bias, a per-head norm's head_dim), each head's dims as head_row_order says; None without one."""
    order = head_row_order(cfg)
    if order is None:
        return None
    hd = cfg.head_dim
    if rows == hd:   # a per-head norm's weight
        return order
    heads = cfg.num_heads + 2 * cfg.num_kv_heads if fused else rows // hd
    ordered = cfg.num_heads + cfg.num_kv_heads if fused else heads   # v keeps its order
    per_head = [h * hd + (order if h < ordered else np.arange(hd)) for h in range(heads)]
    return np.concatenate(per_head)


def takes_long_factors(cfg: ModelConfig, prompt_len: int) -> bool:
    """Whether a sequence with a prompt of prompt_len tokens takes LongRoPE's long factors for every token, as
    transformers' one forward over its prompt does (False without LongRoPE)."""
    return cfg.rope_longrope is not None and prompt_len > cfg.rope_longrope[2]


def cos_sin(cfg: ModelConfig, ops: ModuleType, positions: jax.Array, token_seq: jax.Array, num_seqs: int,
            dtype: jnp.dtype, decode: bool, rope_long: jax.Array | None = None) -> Tables:
    """The step's cos and sin [T, head_dim] (two bases: [2, T, head_dim] each, the global layers' first; pick a
    layer's with layer_cos_sin). decode: token t is sequence t's one token; else token_seq [T] maps tokens to their
    sequence. LongRoPE's factors: with rope_long (bool [num_seqs], the sequence's prompt is longer than the
    original length) the long ones for its sequences' tokens and for every token past that length; without it
    (and not decode) the long ones for the sequences whose last position in the step is past it."""
    if cfg.rope_longrope is not None:
        short, long_, orig, factor = cfg.rope_longrope
        if decode or rope_long is not None:   # each token its own position (a decode step's is its sequence's end)
            end = positions
        else:
            end = jax.ops.segment_max(positions, token_seq, num_segments=num_seqs)[token_seq]
        scale = np.ones(cfg.head_dim // 2, np.float32)
        scale[:cfg.rotary_dim // 2] = factor   # transformers scales cos and sin of the rotated dims in float32
        scale = jnp.asarray(np.concatenate([scale, scale]))
        tables = [ops.rope_cos_sin(positions, jnp.asarray(cfg.rope_inv_freq(long=lg)), jnp.float32)
                  for lg in (False, True)]
        use_long = (end + 1 > orig) | (False if rope_long is None else rope_long[token_seq])
        use_long = use_long[:, None]
        return tuple(jnp.where(use_long, a_long * scale, a_short * scale).astype(dtype)
                     for a_short, a_long in zip(*tables))
    table = ops.rope_cos_sin(positions, jnp.asarray(cfg.rope_inv_freq()), dtype)
    if not cfg.rope_local_theta:
        return table
    local = ops.rope_cos_sin(positions, jnp.asarray(cfg.rope_inv_freq(theta=cfg.rope_local_theta)), dtype)
    return jnp.stack([table[0], local[0]]), jnp.stack([table[1], local[1]])


def layer_cos_sin(cfg: ModelConfig, tables: Tables | None, layer: jax.Array) -> Tables | None:
    """The cos and sin of `layer` (a traced index is fine) from cos_sin's tables."""
    if tables is None or not cfg.rope_local_theta:
        return tables
    local = jnp.asarray(cfg.rope_local_layers, jnp.int32)[layer]
    return tables[0][local], tables[1][local]
