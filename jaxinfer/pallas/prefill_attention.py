"""Paged prefill attention, flash-attention style, as a Pallas Triton kernel.

`paged_prefill_attention(q [T, H, hd], k_cache, v_cache [L, KVH, slots, hd], layer, page_table [B, P],
query_start [B + 1], positions [T], page_size, scale) -> [T, H, hd]`: the ragged query tokens of several
sequences in one launch. Sequence b owns rows query_start[b] .. query_start[b + 1] - 1 (contiguous, in
order); row t attends causally to its sequence's cached positions 0..positions[t], read in place from
the pages of page_table[b] -- including a prefix cached by earlier steps, so a chunk of a long prompt
attends to everything before it. Rows outside query_start[0]..query_start[B]-1 (padding) come back
as zeros.
`paged_attention` is an adapter with the signature of `reference.paged_attention` (token_seq instead of
query_start), for the engine's layout.

The grid is (programs, head groups). A program owns one query block: up to `block_q` consecutive rows
of one sequence and the `heads` query heads of one KV head (by default the whole GQA group), held as one
[block_q x heads, hd] tile (row r = token r // heads, head r % heads), so every K/V tile it loads serves
all of them. Which sequence and rows program i owns comes from a small schedule array [3, N] computed
with XLA from query_start (`prefill_schedule`): sequence index, first row, end row of its sequence.
N = T // block_q + B + 2 is a static bound on the number of query blocks (sum over segments of
ceil(n / block_q)); the unused entries are empty and exit at once. The schedule is sorted so that the
programs with the most keys to visit start first (the causal blocks at the end of a long prompt), so
the light ones fill the tail of the launch. Grid axis 0 (launched fastest) walks the schedule and axis 1
the head groups, so the programs resident at one time read the K/V of one KV head: L2 reuse when a
long context's K/V (16 MB per KV head at 32k, bf16) do not all fit in the 50 MB L2.

A program walks the key positions its rows can see, 0..max(position)+1, in blocks of `block_k`: the
block's page-table entries are gathered (position p -> page_table[b, p // page_size], the next block's
loaded beside this block's K/V), K and V rows are read in place through those slots, scores = q k^T on
the tensor cores, online softmax in float32 (base 2, scale folded in), acc += p v. The blocks below
min(position)+1 are visible to every row and run without the causal mask; the remaining (diagonal)
blocks apply it per row (key position <= the row's own position, so rows need not be sorted).

A sliding window (`window`, a traced int32 scalar, 0 for a global layer): row t sees positions[t] - window + 1 ..
positions[t]. A program starts at the block of its rows' lowest such position (the blocks before it, and their
page-table entries, are never read), masks the blocks that the window cuts into per row, and runs the blocks that
every row sees whole unmasked as before. (Padding rows sit at position 0 of sequence 0: where they share a program
with sequence 0's rows, it reads from position 0, through the scratch page of a freed entry.)

Every block dimension is a power of two and the tails are masked (../shared/GPU_FACTS.md: a block over a
non-power-of-two dimension gave silently wrong results): the head group is padded to a power of two,
hd to a power of two >= 16, and row/column masks guard every load and store. Masked scores are a
large finite negative, never -inf; rows that see no key write zeros; no NaN from padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.tables import PrefillConfig
from jaxinfer.pallas.blocks import (dot_precision, is_pow2, kv_block_for_head_dim, online_softmax_update, page_slots,
                                     pow2_at_least)

f32 = jnp.float32
i32 = jnp.int32
LOG2E = math.log2(math.e)
NEG = -1e30  # masked score: finite, so max/exp2 never see -inf - -inf


def heads_per_program(cfg: PrefillConfig, group: int) -> int:
    return group if cfg.heads == 0 else cfg.heads


def num_programs(num_tokens: int, num_segments: int, block_q: int) -> int:
    """Static bound on the query blocks of `num_segments` row ranges covering `num_tokens` rows."""
    return num_tokens // block_q + num_segments


# ---------------------------------------------------------------------------------------------------
# Schedule (XLA, tiny arrays)

def _schedule_from_segments(starts, ends, seqs, positions, num_tokens: int, block_q: int, order: str):
    """[3, N] int32 (sequence or -1, first row, end row) per program, from S row ranges [start, end) of
    sequences `seqs` (-1: padding rows, written as zeros). N = num_tokens // block_q + S."""
    S = starts.shape[0]
    N = num_programs(num_tokens, S, block_q)
    starts = jnp.clip(starts.astype(i32), 0, num_tokens)
    ends = jnp.clip(jnp.maximum(ends.astype(i32), starts), 0, num_tokens)
    counts = (ends - starts + block_q - 1) // block_q
    cum = jnp.cumsum(counts)                                     # inclusive
    j = jnp.arange(N, dtype=i32)
    seg = jnp.minimum(jnp.sum(cum[None, :] <= j[:, None], axis=1, dtype=i32), S - 1)
    live = j < cum[-1]
    row0 = starts[seg] + (j - (cum[seg] - counts[seg])) * block_q
    row0 = jnp.where(live, row0, 0)
    row_end = jnp.where(live, ends[seg], 0)
    seq = jnp.where(live, seqs.astype(i32)[seg], -1)
    sched = jnp.stack([seq, row0, row_end])
    if order == "work":
        last = jnp.clip(jnp.minimum(row0 + block_q, row_end) - 1, 0, max(num_tokens - 1, 0))
        work = jnp.where(seq >= 0, positions.astype(i32)[last] + 1, 0)
        work = jnp.where(live, work, -1)
        sched = sched[:, jnp.argsort(-work, stable=True)]
    elif order != "natural":
        raise ValueError(f"order={order!r}")
    return sched


@functools.partial(jax.jit, static_argnames=("num_tokens", "block_q", "order"))
def prefill_schedule(query_start: jax.Array, positions: jax.Array, num_tokens: int, block_q: int,
                     order: str = "work") -> jax.Array:
    """The schedule of `paged_prefill_attention` from query_start [B + 1]: [3, T // block_q + B + 2].

    Loop-invariant across layers: a caller may compute it once per step and pass it as `schedule=`.
    Segments: the B sequences, then the rows before query_start[0] and after query_start[B] (padding).
    """
    qs = jax.lax.cummax(jnp.clip(query_start.astype(i32), 0, num_tokens))
    B = qs.shape[0] - 1
    zero, end = jnp.zeros((1,), i32), jnp.full((1,), num_tokens, i32)
    starts = jnp.concatenate([qs[:-1], zero, qs[-1:]])
    ends = jnp.concatenate([qs[1:], qs[:1], end])
    seqs = jnp.concatenate([jnp.arange(B, dtype=i32), jnp.full((2,), -1, i32)])
    return _schedule_from_segments(starts, ends, seqs, positions, num_tokens, block_q, order)


@functools.partial(jax.jit, static_argnames=("num_seqs", "block_q", "order"))
def schedule_from_token_seq(token_seq: jax.Array, positions: jax.Array, num_seqs: int, block_q: int,
                            order: str = "work") -> jax.Array:
    """The schedule from token_seq [T] (the reference's signature): every run of equal token_seq is a
    segment. At most num_seqs + 1 runs are scheduled (the engine's layout: each sequence's rows contiguous,
    then padding rows with token_seq 0); rows of further runs would not be written. The schedule has the
    shape of `prefill_schedule`'s, [3, T // block_q + num_seqs + 2] (one segment slot always empty)."""
    T = token_seq.shape[0]
    S = num_seqs + 2
    ts = token_seq.astype(i32)
    new = jnp.concatenate([jnp.ones((1,), bool), ts[1:] != ts[:-1]])
    seg_id = jnp.cumsum(new.astype(i32)) - 1
    rows = jnp.arange(T, dtype=i32)
    starts = jnp.full((S,), T, i32).at[seg_id].min(rows, mode="drop")
    ends = jnp.zeros((S,), i32).at[seg_id].max(rows + 1, mode="drop")
    seqs = jnp.zeros((S,), i32).at[seg_id].max(ts, mode="drop")
    return _schedule_from_segments(starts, ends, seqs, positions, T, block_q, order)


# ---------------------------------------------------------------------------------------------------
# Kernel

def _kernel(layer_ref, sched_ref, pos_ref, pt_ref, *refs, hd, D, group, heads, HP,
            block_q, block_k, page_size, n_pages, qk_scale, windowed=False):
    win_ref, q_ref, k_ref, v_ref, o_ref = refs if windowed else (None, *refs)
    i = pl.program_id(0)
    hp = pl.program_id(1)
    seq = plgpu.load(sched_ref.at[jnp.int32(0), i])
    row0 = plgpu.load(sched_ref.at[jnp.int32(1), i])
    row_end = plgpu.load(sched_ref.at[jnp.int32(2), i])

    @pl.when(row0 < row_end)
    def _():
        layer = plgpu.load(layer_ref.at[jnp.int32(0)])
        kvh = (hp * heads) // group
        M = block_q * HP
        r = jnp.arange(M, dtype=i32)
        t = row0 + r // HP                                    # query row of tile row r
        hh = r % HP
        head = hp * heads + hh
        row_ok = t < row_end
        if HP != heads:
            row_ok = row_ok & (hh < heads)
        cols = jnp.arange(D, dtype=i32)
        col_ok = cols < hd
        ragged_cols = D != hd
        t_ld = jnp.minimum(t, row_end - 1)                    # in-bounds indices for masked loads
        head_ld = jnp.minimum(head, hp * heads + heads - 1)
        q_mask = row_ok[:, None] & col_ok[None, :] if ragged_cols else row_ok[:, None]
        q = plgpu.load(q_ref.at[t_ld[:, None], head_ld[:, None], cols[None, :]], mask=q_mask, other=0)

        span = n_pages * page_size
        qpos = jnp.minimum(plgpu.load(pos_ref.at[t_ld], mask=row_ok, other=0), span - 1)   # [M]
        has_kv = seq >= 0
        hi = jnp.max(jnp.where(row_ok, qpos, -1)) + 1           # keys [0, hi) seen by some row
        lo = jnp.min(jnp.where(row_ok, qpos, span)) + 1         # keys [0, lo) seen by every row
        hi = jnp.where(has_kv, jnp.maximum(hi, 0), 0)
        lo = jnp.where(has_kv, jnp.maximum(lo, 0), 0)
        n_full = lo // block_k
        n_blocks = pl.cdiv(hi, block_k)
        pt_row = jnp.maximum(seq, 0)
        offs = jnp.arange(block_k, dtype=i32)
        prec = dot_precision(q.dtype)
        first = unmasked_from = jnp.int32(0)    # blocks [first, unmasked_from) and [n_full, n_blocks) are masked
        qfloor = min_floor = None
        if windowed:   # row t sees keys qfloor[t]..qpos[t]: the blocks before the lowest floor are never visited
            window = plgpu.load(win_ref.at[jnp.int32(0)])
            qfloor = jnp.where(window > 0, jnp.maximum(qpos - window + 1, 0), 0)               # [M]
            min_floor = jnp.min(jnp.where(row_ok, qfloor, span))
            max_floor = jnp.max(jnp.where(row_ok, qfloor, 0))                  # keys [max_floor, lo): every row
            first = jnp.minimum(min_floor // block_k, n_blocks)
            unmasked_from = jnp.clip(pl.cdiv(max_floor, block_k), first, n_blocks)
            n_full = jnp.maximum(n_full, unmasked_from)

        def slots_of(j):
            return page_slots(pt_ref, pt_row, j * block_k + offs, hi, page_size, n_pages, min_floor)

        def step(j, carry, causal):
            acc, m, l, slot = carry
            nxt = slots_of(j + 1)
            pos = j * block_k + offs
            if causal:
                in_range = pos < hi if min_floor is None else (pos < hi) & (pos >= min_floor)
                kv_mask = in_range[:, None] & col_ok[None, :] if ragged_cols else in_range[:, None]
            else:
                kv_mask = col_ok[None, :] if ragged_cols else None
            other = None if kv_mask is None else 0.0   # a float: Triton casts no int to float8
            k = plgpu.load(k_ref.at[layer, kvh, slot[:, None], cols[None, :]], mask=kv_mask, other=other)
            v = plgpu.load(v_ref.at[layer, kvh, slot[:, None], cols[None, :]], mask=kv_mask, other=other)
            if k.dtype != q.dtype:
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                     preferred_element_type=f32) * qk_scale        # [M, block_k]
            if causal:
                seen = pos[None, :] <= qpos[:, None]
                if windowed:
                    seen = seen & (pos[None, :] >= qfloor[:, None])
                sc = jnp.where(seen, sc, NEG)
            return (*online_softmax_update(acc, m, l, sc, v, prec), nxt)

        init = (jnp.zeros((M, D), f32), jnp.full((M,), NEG, f32), jnp.zeros((M,), f32), slots_of(first))
        if windowed:   # the blocks that the window cuts into, below those every row sees whole
            init = jax.lax.fori_loop(first, unmasked_from, functools.partial(step, causal=True), init)
        carry = jax.lax.fori_loop(unmasked_from, n_full, functools.partial(step, causal=False), init)
        acc, _, l, _ = jax.lax.fori_loop(n_full, n_blocks, functools.partial(step, causal=True), carry)

        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        o_mask = row_ok[:, None] & col_ok[None, :] if ragged_cols else row_ok[:, None]
        # Unclamped indices here: masked rows then never alias a written row (interpret mode stores a
        # masked element by writing back its old value, and drops indices past the end).
        plgpu.store(o_ref.at[t[:, None], head[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=o_mask)


def _validate(q, k_cache, v_cache, page_table, cfg: PrefillConfig):
    _, H, hd = q.shape
    KVH, hd_k = k_cache.shape[1], k_cache.shape[3]
    if v_cache.shape != k_cache.shape or hd_k != hd:
        raise ValueError(f"paged_prefill_attention: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if H % KVH:
        raise ValueError(f"paged_prefill_attention: {H} query heads over {KVH} KV heads")
    if page_table.ndim != 2:
        raise ValueError(f"paged_prefill_attention: page_table {page_table.shape}")
    group = H // KVH
    heads = heads_per_program(cfg, group)
    if heads < 1 or group % heads:
        raise ValueError(f"heads={cfg.heads} must divide the group of {group} query heads per KV head")
    if not (is_pow2(cfg.block_q) and is_pow2(cfg.block_k) and cfg.block_k >= 16):
        raise ValueError(f"block_q={cfg.block_q} and block_k={cfg.block_k} must be powers of two "
                         f"(block_k >= 16)")
    if cfg.block_q * pow2_at_least(heads) < 16:
        raise ValueError(f"block_q={cfg.block_q} x {heads} heads: a tile needs >= 16 rows")
    if cfg.order not in ("work", "natural"):
        raise ValueError(f"order={cfg.order!r}")
    return group, heads


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "config", "interpret"))
def _call(q, k_cache, v_cache, layer, page_table, positions, schedule, window=None, *, page_size: int,
          scale: float, config: PrefillConfig, interpret: bool):
    T, H, hd = q.shape
    group, heads = _validate(q, k_cache, v_cache, page_table, config)
    HP = pow2_at_least(heads)
    D = pow2_at_least(hd, 16)
    N = schedule.shape[1]
    kernel = functools.partial(
        _kernel, hd=hd, D=D, group=group, heads=heads, HP=HP, block_q=config.block_q, block_k=config.block_k,
        page_size=page_size, n_pages=page_table.shape[1], qk_scale=float(scale) * LOG2E,
        windowed=window is not None)
    windowed = () if window is None else (jnp.asarray(window, i32).reshape(1),)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((T, H, hd), q.dtype), grid=(N, H // heads),
        interpret=interpret, name="prefill_attention",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(jnp.asarray(layer, i32).reshape(1), schedule.astype(i32), positions.astype(i32),
      page_table.astype(i32), *windowed, q, k_cache, v_cache)


# ---------------------------------------------------------------------------------------------------
# Configuration (the measured rows: tables.PREFILL_ATTENTION)

def config_for_rows(cfg: PrefillConfig, rows: int, num_tokens: int, group: int, head_dim: int) -> PrefillConfig:
    """cfg with block_q set so that a tile has about `rows` rows for this group (and >= 16), no larger
    than the call's T needs, and halved for head_dim > 128 (the float32 accumulator is rows x hd); K/V blocks of
    fewer positions past head_dim 128 (blocks.kv_block_for_head_dim: the pipeline's shared memory)."""
    if cfg.heads and group % cfg.heads:
        cfg = dataclasses.replace(cfg, heads=0)
    hp = pow2_at_least(heads_per_program(cfg, group))
    min_bq = pow2_at_least(-(-16 // hp))
    if head_dim > 128:
        rows //= 2
    bq = pow2_at_least(max(1, rows // hp))
    bq = min(bq, pow2_at_least(max(num_tokens, 1)))
    return dataclasses.replace(cfg, block_q=max(bq, min_bq), block_k=kv_block_for_head_dim(cfg.block_k, head_dim))


def choose_config(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> PrefillConfig:
    """The configuration for a call with T = num_tokens rows (static), H / KVH heads of head_dim."""
    rows, cfg = next((r, c) for max_t, r, c in tables.PREFILL_ATTENTION if num_tokens <= max_t)
    return config_for_rows(cfg, rows, num_tokens, num_heads // num_kv_heads, head_dim)


# ---------------------------------------------------------------------------------------------------
# Public ops

def paged_prefill_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                            page_table: jax.Array, query_start: jax.Array, positions: jax.Array,
                            page_size: int, scale: float, *, config: PrefillConfig | None = None,
                            schedule: jax.Array | None = None, window: jax.Array | int | None = None,
                            interpret: bool = False) -> jax.Array:
    """Causal attention of ragged query rows over their own sequence's pages (flash-attention kernel).

    q [T, H, hd]; k_cache, v_cache [L, KVH, slots, hd]; layer int32 scalar; page_table [B, P] int32;
    query_start [B + 1] int32 (sequence b owns rows query_start[b]..query_start[b+1]-1; query_start[0]
    is normally 0); positions [T] int32 (row t sees positions 0..positions[t] of its sequence).
    Returns [T, H, hd] in q's dtype; rows outside query_start[0]..query_start[B]-1 are zeros.
    `config` overrides the table; `schedule` (from `prefill_schedule` with the same block_q and T)
    skips recomputing the per-call schedule, e.g. once per step instead of once per layer. `window`: a sliding
    window (int32 scalar, 0 global): row t sees positions positions[t] - window + 1..positions[t], and the key
    blocks before its program's lowest such position are skipped.
    """
    T, H, hd = q.shape
    if config is None:
        config = choose_config(T, H, k_cache.shape[1], hd)
    _validate(q, k_cache, v_cache, page_table, config)
    if query_start.shape != (page_table.shape[0] + 1,):
        raise ValueError(f"paged_prefill_attention: query_start {query_start.shape}, "
                         f"page_table {page_table.shape}")
    if schedule is None:
        schedule = prefill_schedule(query_start, positions, T, config.block_q, config.order)
    elif schedule.shape != (3, num_programs(T, page_table.shape[0] + 2, config.block_q)):
        raise ValueError(f"paged_prefill_attention: schedule {schedule.shape} is not prefill_schedule's "
                         f"for T={T}, B={page_table.shape[0]}, block_q={config.block_q}")
    return _call(q, k_cache, v_cache, layer, page_table, positions, schedule, window, page_size=page_size,
                 scale=float(scale), config=config, interpret=interpret)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                    page_table: jax.Array, token_seq: jax.Array, positions: jax.Array, page_size: int,
                    scale: float, *, config: PrefillConfig | None = None, window: jax.Array | int | None = None,
                    interpret: bool = False) -> jax.Array:
    """`reference.paged_attention` (token_seq [T] instead of query_start) on the prefill kernel.

    Requires the engine's layout: each sequence's rows contiguous, at most B + 1 runs of equal token_seq
    (the sequences, then padding rows, token_seq 0, which attend like rows of sequence 0).
    """
    T, H, hd = q.shape
    if config is None:
        config = choose_config(T, H, k_cache.shape[1], hd)
    _validate(q, k_cache, v_cache, page_table, config)
    schedule = schedule_from_token_seq(token_seq, positions, page_table.shape[0], config.block_q, config.order)
    return _call(q, k_cache, v_cache, layer, page_table, positions, schedule, window, page_size=page_size,
                 scale=float(scale), config=config, interpret=interpret)
