"""Paged attention for Q query rows a sequence (a speculative verify step), split-sequence, as Pallas Triton kernels.

`paged_verify_attention(q [B, Q, H, hd], k_cache, v_cache [L, KVH, slots, hd], layer, page_table [B, P],
context_lens [B], page_size, scale) -> [B, Q, H, hd]`: the signature of `reference.verify_attention`. Row j of
sequence b sees positions 0..context_lens[b] - Q + j (the K/V of all Q rows are already in the cache; at least
position 0, as the reference clamps).

The split kernel of pallas/decode_attention.py with more rows a tile. Grid (B, KVH, num_splits): a program owns one
sequence, one KV head and one split of that sequence's positions, and holds the Q rows of the `group` query heads
of its KV head as one [M, hd] tile, tile row r = j * group + g (query row j, head g of the group), M = Q * group
padded to a power of two >= 16. Every K/V block is read once for all Q * group rows, so a verify step reads what a
decode step reads; the tile's extra rows cost tensor-core work and exp2s, not bytes. Each tile row is masked at its
own limit (context_lens[b] - Q + 1 + j positions); the program walks its split up to the last row's limit. A row
can be masked out of a whole block, or a whole split (its limit ends before the split begins): its running max
starts at M_INIT, above the masked score NEG, so masked entries weigh exp2(NEG - M_INIT) = 0 and such a row keeps
l = 0 (lse = NEG, zeros), never the mean of masked values.

With several splits the partials are laid out as [B, Q * H, S, hd] (row j, head h at j * H + h) and merged by
decode_attention's merge kernel (grid (B, Q * H); split 0 always holds position 0, which every row sees); the
output [B, Q * H, hd] is [B, Q, H, hd] by a free reshape. With one split kernel 1 writes the output.

A sliding window (`window`, a traced int32 scalar, 0 global): row j sees its last `window` positions; the splits
share out the blocks from row 0's first position on (window_kv_start), each row masked at its own floor.

num_splits, block_k and num_warps (static: the grid and the tile) come from `choose_config`, tables.VERIFY_ATTENTION,
keyed by tile rows, sequence-heads (batch x KVH) and the page table's span. Float8 pages multiply in float16 as in
the decode kernel (blocks.page_compute_dtype). An INT8 cache comes as its values and two more operands, k_scale and
v_scale [L, KVH, slots], read as the decode kernel reads them (decode_attention.py: int8 tiles converted exactly, a
key's scale on its column of scores, a value's on its probability). Every block dimension is a power of two with
masked tails; masked
scores are a large finite negative, never -inf. `supports(rows, head_dim)`: the tiles this kernel takes (the op set
falls back to the reference op elsewhere).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import (dot_precision, is_pow2, kv_block_for_head_dim, online_softmax_update,
                                     page_compute_dtype, page_slots, pow2_at_least, to_compute)
from jaxinfer.pallas.decode_attention import (LOG2E, NEG, check_int8_operands, load_kv_tiles,
                                              resolve_int8_convert, merge_splits,
                                              online_softmax_update_scaled, window_split_range)
from jaxinfer.pallas.tables import SplitConfig

f32 = jnp.float32
M_INIT = NEG / 2   # a row's running max before its first visible score: above NEG, so masked scores weigh 0
MAX_ROWS = 128     # Q x group rows a tile (an [M, hd] float32 accumulator a program)
MAX_TILE = 128 * 128   # M x padded hd: hd 256 takes up to 64 rows


def supports(rows: int, head_dim: int) -> bool:
    """Whether the kernel takes Q x group = `rows` tile rows of `head_dim`."""
    return 1 <= rows <= MAX_ROWS and pow2_at_least(rows, 16) * pow2_at_least(head_dim, 16) <= MAX_TILE


def _split_kernel(layer_ref, pt_ref, cl_ref, *refs, Q, H, group, M, hd, D, page_size,
                  n_pages, block_k, num_splits, qk_scale, quantized, int8_convert, windowed=False):
    win_ref, q_ref, k_ref, v_ref, *refs = refs if windowed else (None, *refs)
    ks_ref, vs_ref, *out_refs = refs if quantized else (None, None, *refs)
    b = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    layer = plgpu.load(layer_ref.at[jnp.int32(0)])
    span = n_pages * page_size
    ctx = plgpu.load(cl_ref.at[b])

    rows = jnp.arange(M, dtype=jnp.int32)
    cols = jnp.arange(D, dtype=jnp.int32)
    row_mask = rows < Q * group
    col_mask = cols < hd
    # Query row and head of each tile row. Padding rows (j >= Q) are masked; their indices stay past the end, never
    # on a real row: interpret mode stores a masked row by writing back what it read, and a duplicate would race.
    j = rows // group
    head = h * group + rows % group
    # Positions row j sees: ctx - Q + 1 + j, at least 1 (position 0, as the reference clamps) and at most the span.
    last = jnp.clip(ctx, 1, span)                 # the last row's limit: the program walks up to it
    limit = jnp.clip(ctx - Q + 1 + j, 1, last)
    tile_mask = row_mask[:, None] & col_mask[None, :]
    q = plgpu.load(q_ref.at[b, j[:, None], head[:, None], cols[None, :]], mask=tile_mask, other=0)

    first = floor = None
    if windowed:   # row j sees from limit - window on; the program from row 0's floor (window_kv_start's)
        window = plgpu.load(win_ref.at[jnp.int32(0)])
        floor = jnp.where(window > 0, jnp.maximum(limit - window, 0), 0)
        first = jnp.where(window > 0, jnp.maximum(jnp.clip(ctx - Q + 1, 1, last) - window, 0), 0)
    start, stop = window_split_range(last, first, block_k, s, num_splits)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cdt = page_compute_dtype(k_ref.dtype, q.dtype)   # float8 pages: float16 products
    q = to_compute(q, cdt)
    prec = dot_precision(cdt)
    ragged_cols = D != hd

    def slots_of(i):
        """Cache slots of block i's positions, gathered from the page table (slot 0 past the last row's limit)."""
        return page_slots(pt_ref, b, i * block_k + offs, last, page_size, n_pages, first)

    def body(i, carry):
        acc, m, l, slot = carry
        pos = i * block_k + offs
        nxt = slots_of(i + 1)   # the next block's page-table entries, off the loop's latency chain
        valid = pos < last if first is None else (pos < last) & (pos >= first)
        kv_mask = valid[:, None] & col_mask[None, :] if ragged_cols else valid[:, None]
        k, v = load_kv_tiles(k_ref, v_ref, layer, h, slot, cols, kv_mask, cdt, quantized, int8_convert)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=f32)
        seen = pos[None, :] < limit[:, None]                                    # [M, block_k], causal per row
        if windowed:
            seen = seen & (pos[None, :] >= floor[:, None])
        if not quantized:
            sc = jnp.where(seen, sc * qk_scale, NEG)
            return (*online_softmax_update(acc, m, l, sc, v, prec), nxt)
        k_scale = plgpu.load(ks_ref.at[layer, h, slot], mask=valid, other=0.0)   # [block_k]
        v_scale = plgpu.load(vs_ref.at[layer, h, slot], mask=valid, other=0.0)
        sc = jnp.where(seen, sc * (k_scale * qk_scale)[None, :], NEG)
        return (*online_softmax_update_scaled(acc, m, l, sc, v, v_scale, prec), nxt)

    init = (jnp.zeros((M, D), f32), jnp.full((M,), M_INIT, f32), jnp.zeros((M,), f32), slots_of(start))
    acc, m, l, _ = jax.lax.fori_loop(start, stop, body, init)

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs   # [B, Q, H, hd]
        plgpu.store(o_ref.at[b, j[:, None], head[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=tile_mask)
    else:
        o_ref, lse_ref = out_refs   # [B, Q * H, S, hd] f32, [B, Q * H, S] f32
        qh = j * H + head
        plgpu.store(o_ref.at[b, qh[:, None], s, cols[None, :]], out, mask=tile_mask)
        lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG)
        plgpu.store(lse_ref.at[b, qh, s], lse, mask=row_mask)


def _check_shapes(q, k_cache, v_cache, page_table, context_lens) -> None:
    if q.ndim != 4 or k_cache.ndim != 4:
        raise ValueError(f"verify_attention: q {q.shape} is not [B, Q, H, hd] or k {k_cache.shape} not [L, KVH, "
                         f"slots, hd]")
    B, Q, H, hd = q.shape
    KVH = k_cache.shape[1]
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != hd:
        raise ValueError(f"verify_attention: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    if H % KVH:
        raise ValueError(f"verify_attention: {H} query heads over {KVH} KV heads")
    if page_table.ndim != 2 or page_table.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"verify_attention: page_table {page_table.shape}, context_lens {context_lens.shape}, "
                         f"batch {B}")
    if not supports(Q * (H // KVH), hd):
        raise ValueError(f"verify_attention: {Q} rows x group {H // KVH} at head_dim {hd} exceed the kernel's tile "
                         f"(supports: rows <= {MAX_ROWS}, rows x head_dim <= {MAX_TILE}, both padded)")


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "num_splits", "block_k", "num_warps",
                                             "num_stages", "merge", "int8_convert", "interpret"))
def paged_verify_attention_split(q, k_cache, v_cache, layer, page_table, context_lens, page_size: int,
                                 scale: float, *, num_splits: int = 1, block_k: int = 64, num_warps: int = 4,
                                 num_stages: int = 2, merge: str = "pallas", k_scale=None, v_scale=None,
                                 int8_convert: str = "cvt", window=None, interpret: bool = False):
    """The kernels with an explicit configuration (see SplitConfig); k_scale, v_scale with int8 caches; window: a
    sliding window (int32 scalar, 0 global)."""
    _check_shapes(q, k_cache, v_cache, page_table, context_lens)
    int8_convert = resolve_int8_convert(int8_convert, interpret)
    quantized = check_int8_operands("verify_attention", k_cache, v_cache, k_scale, v_scale, int8_convert)
    B, Q, H, hd = q.shape
    KVH = k_cache.shape[1]
    group = H // KVH
    if not (is_pow2(num_splits) and is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"num_splits={num_splits} and block_k={block_k} must be powers of two (block_k >= 16)")
    if merge not in ("pallas", "jnp"):
        raise ValueError(f"merge={merge!r}")
    M = pow2_at_least(Q * group, 16)
    D = pow2_at_least(hd, 16)
    n_pages = page_table.shape[1]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    page_table = page_table.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)

    kernel = functools.partial(
        _split_kernel, Q=Q, H=H, group=group, M=M, hd=hd, D=D, page_size=page_size, n_pages=n_pages,
        block_k=block_k, num_splits=num_splits, qk_scale=float(scale) * LOG2E, quantized=quantized,
        int8_convert=int8_convert, windowed=window is not None)
    windowed = () if window is None else (jnp.asarray(window, jnp.int32).reshape(1),)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((B, Q, H, hd), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((B, Q * H, num_splits, hd), f32),
                     jax.ShapeDtypeStruct((B, Q * H, num_splits), f32))
    res = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, KVH, num_splits), interpret=interpret, name="verify_attention_split",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(layer, page_table, context_lens, *windowed, q, k_cache, v_cache, *((k_scale, v_scale) if quantized else ()))
    if num_splits == 1:
        return res
    # Split 0 holds position 0 for every row (context_lens <= 0 included: the merge then reads split 0 alone); with
    # a window, row 0's first position, which every row sees
    kv_start = None if window is None else window_kv_start(context_lens, Q, window, n_pages * page_size)
    out = merge_splits(*res, q.dtype, hd, merge, interpret, context_lens=context_lens, block_k=block_k,
                       max_ctx=n_pages * page_size, kv_start=kv_start)
    return out.reshape(B, Q, H, hd)


def window_kv_start(context_lens: jax.Array, Q: int, window: jax.Array | int, span: int) -> jax.Array:
    """The first position [B] of row 0's sliding window (the kernel's `first`): every row sees it, and the blocks
    before it are skipped."""
    last = jnp.clip(context_lens, 1, span)
    return jnp.where(window > 0, jnp.maximum(jnp.clip(context_lens - Q + 1, 1, last) - window, 0), 0).astype(jnp.int32)


def choose_config(rows: int, batch: int, kv_heads: int, span: int, head_dim: int = 128) -> SplitConfig:
    """The split configuration for tiles of `rows` (Q x group) rows, `batch` sequences, `kv_heads` KV heads and
    page tables spanning `span` positions (tables.VERIFY_ATTENTION), K/V blocks fitted to `head_dim`."""
    seq_heads = batch * kv_heads
    cfg = next(c for max_rows, max_sh, max_span, c in tables.VERIFY_ATTENTION
               if rows <= max_rows and seq_heads <= max_sh and span <= max_span)
    cfg = dataclasses.replace(cfg, block_k=kv_block_for_head_dim(cfg.block_k, head_dim))
    s = cfg.num_splits   # never more splits than blocks in the span (the extra ones would be empty programs)
    while s > 1 and s * cfg.block_k >= 2 * span:
        s //= 2
    return dataclasses.replace(cfg, num_splits=s)


def paged_verify_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                           page_table: jax.Array, context_lens: jax.Array, page_size: int, scale: float, *,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           config: SplitConfig | None = None, int8_convert: str | None = None,
                           window: jax.Array | int | None = None, interpret: bool = False) -> jax.Array:
    """`reference.verify_attention` with the split-sequence Pallas kernels.

    q [B, Q, H, hd]; k_cache, v_cache [L, KVH, slots, hd] (bf16, f32, float8, or int8 with their scales k_scale,
    v_scale [L, KVH, slots] float32); layer int32 scalar; page_table [B, P] int32; context_lens [B] int32 (the last
    row's position + 1). Returns [B, Q, H, hd] in q's dtype. `config` overrides the table (tests and benchmarks);
    int8_convert the int8 conversion (default tables.DECODE_ATTENTION_INT8_CONVERT). Needs supports(Q * H / KVH, hd).
    `window`: a sliding window (int32 scalar, 0 global): row j sees its last `window` positions; the blocks before
    row 0's first are skipped.
    """
    _check_shapes(q, k_cache, v_cache, page_table, context_lens)
    if config is None:
        B, Q, H, hd = q.shape
        config = choose_config(Q * (H // k_cache.shape[1]), B, k_cache.shape[1], page_table.shape[1] * page_size, hd)
    return paged_verify_attention_split(
        q, k_cache, v_cache, layer, page_table, context_lens, page_size, float(scale),
        num_splits=config.num_splits, block_k=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, merge=config.merge, k_scale=k_scale, v_scale=v_scale,
        int8_convert=int8_convert or tables.DECODE_ATTENTION_INT8_CONVERT, window=window, interpret=interpret)
