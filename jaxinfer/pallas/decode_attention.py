"""Paged decode attention, split-sequence ("flash-decoding"), as Pallas Triton kernels.

`paged_decode_attention(q [B, H, hd], k_cache, v_cache [L, KVH, slots, hd], layer, page_table [B, P],
context_lens [B], page_size, scale) -> [B, H, hd]`: one query token per sequence attending over
positions 0..context_lens[b]-1 of its own pages (the signature of `reference.paged_decode_attention`).

Kernel 1, grid (B, KVH, num_splits). A program owns one sequence, one KV head and one split of that
sequence's positions. It holds the `group = H / KVH` query heads of its KV head as one [G, hd] tile
(G = group padded to a power of two >= 16, the smallest M of a Triton dot; padding rows are masked
out), so every K/V tile is loaded once for all of them. It walks its split in blocks of `block_k`
positions: the block's page-table entries are gathered (position p -> page_table[b, p // page_size]),
then K and V rows are read in place from the cache through those slots (no gather copy), scores
[G, block_k] = q k^T on the tensor cores, online softmax in float32 (base 2, the scale folded in),
acc [G, hd] += p v. It writes its normalised partial output and its log2-sum-exp per query head.

Kernel 2, grid (B, H): merges the splits of one query head, [num_splits, hd] in one load, weights
2^(lse_s - max lse). With one split, kernel 1 writes the final output itself and there is no kernel 2.

Splits are sized at run time from each sequence's own context length: a sequence of n blocks gives
each split ceil(n / num_splits) blocks, so a short sequence in a wide page table does not leave its
work to one program. num_splits and block_k (static: the grid and the tile) come from `choose_config`,
a table keyed by sequence-heads (batch x KVH) and the page table's span (P * page_size, the longest
context the call can see), filled from measurements on the H200 (tables.DECODE_ATTENTION).

An INT8 cache comes as two more operands, k_scale and v_scale [L, KVH, slots] (float32, one scale a cached vector:
ops.quantized_cache.QuantizedCache's values are k_cache and v_cache). Pages are never dequantized: the int8 tiles
are converted exactly to the compute dtype (int8_to: INT8_CONVERTS, tables.DECODE_ATTENTION_INT8_CONVERT), each
key's scale multiplies its column of scores, and each value's scale its column of probabilities before p v
(online_softmax_update_scaled: divided by the block's largest value scale, which multiplies the block's p v in
float32 instead, so the scaled probabilities keep float16's range).

A sliding window (`window`, a traced int32 scalar, 0 for a global layer) reaches the kernels as each sequence's
first visible position (window_start: keys in (position - window, position]): the splits share out only the blocks
from the one holding it, positions before it are masked, and the page-table entries before it are never read (the
engine frees those pages and points their entries at the scratch page).

Every block dimension is a power of two and the tails are masked (a block over a non-power-of-two
dimension gave silently wrong results on the GPU: ../shared/GPU_FACTS.md). Masked positions score a
large finite negative, never -inf, and a split with no positions writes lse = -1e30 and zeros, so
padding rows (context 1 on the scratch page), empty splits and masked rows never produce NaN.
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
from jaxinfer.pallas.tables import SplitConfig
from jaxinfer.pallas.blocks import (INT8_CONVERTS, dot_precision, int8_bits_to_f32, is_pow2, kv_block_for_head_dim,
                                     online_softmax_update, page_compute_dtype, page_slots, pow2_at_least,
                                     resolve_int8_convert, split_range, to_compute)

f32 = jnp.float32
LOG2E = math.log2(math.e)
NEG = -1e30  # masked score / empty-split lse: finite, so max/exp2 never see -inf - -inf


# Four int8 values of one 32-bit register to four float16 (two f16x2 registers), exactly: flip the sign bits
# (v + 128 as bytes), byte permutes put each byte under 0x64 (float16 1024 + u), one f16x2 subtract of 1152 a pair.
_PRMT_INT8X4_F16 = """{
.reg .b32 t, c;
xor.b32 t, $2, 0x80808080;
mov.b32 c, 0x64806480;
prmt.b32 $0, t, 0x64646464, 0x5140;
prmt.b32 $1, t, 0x64646464, 0x7362;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}"""


def int8_to(x, dtype, how: str = "cvt"):
    """int8 values x in float `dtype`, exactly. "cvt": the conversion instruction. "bits": v + 128 (1..255) added to
    the bits of 1024.0 (float16; float32: 2^23), which then subtracts 1152 (2^23 + 128): integer adds and one float
    subtraction (I2F runs at a quarter of the FMA rate on Hopper). "prmt" (float16 only; others "cvt"): the same
    float16 built by byte permutes two values an instruction, the subtraction two a f16x2 instruction (inline PTX:
    not in interpret mode, where resolve_int8_convert makes it "cvt")."""
    dtype = jnp.dtype(dtype)
    if how == "prmt" and dtype == jnp.dtype(jnp.float16):
        (y,) = plgpu.elementwise_inline_asm(_PRMT_INT8X4_F16, args=[x], constraints="=r,=r,r", pack=4,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float16)])
        return y
    if how in ("cvt", "prmt"):
        return x.astype(dtype)
    if how != "bits":
        raise ValueError(f"int8 conversion {how!r}: one of {INT8_CONVERTS}")
    if dtype == jnp.dtype(jnp.float16):
        return jax.lax.bitcast_convert_type(x.astype(jnp.int16) + 0x6480, jnp.float16) - jnp.float16(1152.0)
    return int8_bits_to_f32(x).astype(dtype)


def load_kv_tiles(k_ref, v_ref, layer, h, slot, cols, kv_mask, cdt, quantized: bool, int8_convert: str):
    """A block's K and V tiles [block_k, D] from the cache slots `slot` (masked loads read 0), in the compute dtype
    cdt: int8 pages converted exactly (their scales come in later), float8 ones cast."""
    pad = 0 if quantized else 0.0   # a masked load's value, in the pages' kind (int 0 does not cast to float8)
    k = plgpu.load(k_ref.at[layer, h, slot[:, None], cols[None, :]], mask=kv_mask, other=pad)
    v = plgpu.load(v_ref.at[layer, h, slot[:, None], cols[None, :]], mask=kv_mask, other=pad)
    if quantized:
        return int8_to(k, cdt, int8_convert), int8_to(v, cdt, int8_convert)
    if k.dtype != cdt:   # a float8 cache
        k, v = k.astype(cdt), v.astype(cdt)
    return k, v


def online_softmax_update_scaled(acc, m, l, sc, v, v_scale, prec):
    """blocks.online_softmax_update with v [block_k, D] int8 values (in the compute dtype) of scales v_scale
    [block_k]: p's column j multiplied by v_scale[j] / max(v_scale) before the product (in [0, 1], as p is), the
    product by max(v_scale) after, in float32."""
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    v_max = jnp.max(v_scale)
    ratio = v_scale * (1.0 / jnp.where(v_max > 0, v_max, 1.0))
    pv = jax.lax.dot_general((p * ratio[None, :]).astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=f32)
    return acc * alpha[:, None] + pv * v_max, m_new, l


def _split_kernel(layer_ref, pt_ref, cl_ref, *refs, group, G, hd, D, page_size,
                  n_pages, block_k, num_splits, qk_scale, quantized, int8_convert, windowed=False):
    ws_ref, q_ref, k_ref, v_ref, *refs = refs if windowed else (None, *refs)
    ks_ref, vs_ref, *out_refs = refs if quantized else (None, None, *refs)
    b = pl.program_id(0)
    h = pl.program_id(1)
    s = pl.program_id(2)
    layer = plgpu.load(layer_ref.at[jnp.int32(0)])
    ctx = jnp.minimum(plgpu.load(cl_ref.at[b]), n_pages * page_size)
    first = plgpu.load(ws_ref.at[b]) if windowed else None   # a sliding window's first position

    rows = jnp.arange(G, dtype=jnp.int32)
    cols = jnp.arange(D, dtype=jnp.int32)
    row_mask = rows < group
    col_mask = cols < hd
    ragged_rows, ragged_cols = G != group, D != hd
    if ragged_rows or ragged_cols:
        q = plgpu.load(q_ref.at[b, h * group + rows[:, None], cols[None, :]],
                       mask=row_mask[:, None] & col_mask[None, :], other=0)
    else:
        q = plgpu.load(q_ref.at[b, pl.ds(h * group, G), pl.ds(0, D)])

    start, stop = window_split_range(ctx, first, block_k, s, num_splits)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cdt = page_compute_dtype(k_ref.dtype, q.dtype)   # float8 pages: float16 products
    q = to_compute(q, cdt)
    prec = dot_precision(cdt)

    def slots_of(i):
        """Cache slots of block i's positions, gathered from the page table (slot 0 past ctx)."""
        return page_slots(pt_ref, b, i * block_k + offs, ctx, page_size, n_pages, first)

    def body(i, carry):
        acc, m, l, slot = carry
        valid = i * block_k + offs < ctx
        if windowed:
            valid = valid & (i * block_k + offs >= first)
        # The next block's page-table entries are loaded now, beside this block's K and V, so the
        # table lookup is off the loop's latency chain.
        nxt = slots_of(i + 1)
        kv_mask = valid[:, None] & col_mask[None, :] if ragged_cols else valid[:, None]
        k, v = load_kv_tiles(k_ref, v_ref, layer, h, slot, cols, kv_mask, cdt, quantized, int8_convert)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=f32)
        if not quantized:
            sc = jnp.where(valid[None, :], sc * qk_scale, NEG)                 # [G, block_k]
            return (*online_softmax_update(acc, m, l, sc, v, prec), nxt)
        k_scale = plgpu.load(ks_ref.at[layer, h, slot], mask=valid, other=0.0)   # [block_k]
        v_scale = plgpu.load(vs_ref.at[layer, h, slot], mask=valid, other=0.0)
        sc = jnp.where(valid[None, :], sc * (k_scale * qk_scale)[None, :], NEG)
        return (*online_softmax_update_scaled(acc, m, l, sc, v, v_scale, prec), nxt)

    init = (jnp.zeros((G, D), f32), jnp.full((G,), NEG, f32), jnp.zeros((G,), f32), slots_of(start))
    acc, m, l, _ = jax.lax.fori_loop(start, stop, body, init)

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if num_splits == 1:
        (o_ref,) = out_refs
        dst = o_ref.at[b, h * group + rows[:, None], cols[None, :]]
        plgpu.store(dst, out.astype(o_ref.dtype), mask=out_mask)
    else:
        o_ref, lse_ref = out_refs   # [B, H, S, hd] f32, [B, H, S] f32
        plgpu.store(o_ref.at[b, h * group + rows[:, None], s, cols[None, :]], out, mask=out_mask)
        lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG)
        plgpu.store(lse_ref.at[b, h * group + rows, s], lse, mask=row_mask)


def _merge_kernel(cl_ref, *refs, hd, D, num_splits, block_k, max_ctx, cached_offset, windowed=False):
    ws_ref, o_part_ref, lse_ref, o_ref = refs if windowed else (None, *refs)
    b = pl.program_id(0)
    hq = pl.program_id(1)
    cols = jnp.arange(D, dtype=jnp.int32)
    splits = jnp.arange(num_splits, dtype=jnp.int32)
    # Only the splits that had positions are read (split 0 always: the RoPE kernel's new token lives there). An
    # empty split wrote o = 0 and lse = NEG, exactly the masked loads' `other`, so the tile and its sums are
    # the same as reading everything: at a 1k context in a 40k page table 16 of 64 splits hold positions.
    ctx = jnp.minimum(plgpu.load(cl_ref.at[b]), max_ctx) - cached_offset
    start, stop = window_split_range(ctx, plgpu.load(ws_ref.at[b]) if windowed else None, block_k, splits,
                                     num_splits)
    live = (start < stop) | (splits == 0)
    col_mask = cols < hd
    o = plgpu.load(o_part_ref.at[b, hq, splits[:, None], cols[None, :]], mask=live[:, None] & col_mask[None, :],
                   other=0)
    lse = plgpu.load(lse_ref.at[b, hq, splits], mask=live, other=NEG)                # [S]
    w = jnp.exp2(lse - jnp.max(lse))
    out = jnp.sum(o * w[:, None], axis=0) / jnp.sum(w)
    if D != hd:
        plgpu.store(o_ref.at[b, hq, cols], out.astype(o_ref.dtype), mask=col_mask)
    else:
        plgpu.store(o_ref.at[b, hq, pl.ds(0, D)], out.astype(o_ref.dtype))


def window_start(context_lens: jax.Array, window: jax.Array | int) -> jax.Array:
    """The first position [B] int32 that a query at context_lens - 1 sees under a sliding `window` (a scalar; 0 a
    global layer): keys in (position - window, position], as reference.window_floor."""
    cl = jnp.asarray(context_lens, jnp.int32)
    return jnp.where(window > 0, jnp.maximum(cl - window, 0), 0).astype(jnp.int32)


def window_split_range(ctx, first, block_k: int, split, num_splits: int):
    """Blocks [start, stop) of `split` over positions 0..ctx-1, or with a sliding window only the blocks from the
    one holding its `first` position: the blocks before it are never visited (their pages may have been freed)."""
    if first is None:
        return split_range(pl.cdiv(ctx, block_k), split, num_splits)
    skip = first // block_k
    start, stop = split_range(pl.cdiv(ctx, block_k) - skip, split, num_splits)
    return start + skip, stop + skip


def check_int8_operands(name: str, k_cache, v_cache, k_scale, v_scale, int8_convert: str) -> bool:
    """Whether the caches are an INT8 cache (int8 values with k_scale, v_scale [L, KVH, slots] float32); one clear
    error for a half-given or mis-shaped one."""
    given = (k_scale is not None, v_scale is not None)
    int8 = (k_cache.dtype == jnp.int8, v_cache.dtype == jnp.int8)
    if given[0] != given[1] or int8[0] != int8[1] or given[0] != int8[0]:
        raise ValueError(f"{name}: an int8 cache needs int8 k and v values and both scales (k {k_cache.dtype}, "
                         f"v {v_cache.dtype}, k_scale {'given' if given[0] else 'None'}, "
                         f"v_scale {'given' if given[1] else 'None'})")
    if not given[0]:
        return False
    for s in (k_scale, v_scale):
        if s.shape != k_cache.shape[:-1] or s.dtype != f32:
            raise ValueError(f"{name}: scales {s.shape} {s.dtype} for values {k_cache.shape}: want "
                             f"{k_cache.shape[:-1]} float32")
    if int8_convert not in INT8_CONVERTS:
        raise ValueError(f"{name}: int8_convert={int8_convert!r}: one of {INT8_CONVERTS}")
    return True


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "num_splits", "block_k", "num_warps",
                                             "num_stages", "merge", "int8_convert", "interpret"))
def paged_decode_attention_split(q, k_cache, v_cache, layer, page_table, context_lens, page_size: int,
                                 scale: float, *, num_splits: int = 1, block_k: int = 64,
                                 num_warps: int = 4, num_stages: int = 2, merge: str = "pallas",
                                 k_scale=None, v_scale=None, int8_convert: str = "cvt", kv_start=None,
                                 interpret: bool = False):
    """The two kernels with an explicit configuration (see SplitConfig); k_scale, v_scale with int8 caches;
    kv_start [B] int32: a sliding window's first position in each sequence (window_start)."""
    B, H, hd = q.shape
    L, KVH, n_slots, hd_k = k_cache.shape
    if v_cache.shape != k_cache.shape or hd_k != hd:
        raise ValueError(f"paged_decode_attention: q {q.shape}, k {k_cache.shape}, v {v_cache.shape}")
    int8_convert = resolve_int8_convert(int8_convert, interpret)
    quantized = check_int8_operands("paged_decode_attention", k_cache, v_cache, k_scale, v_scale, int8_convert)
    if H % KVH:
        raise ValueError(f"paged_decode_attention: {H} query heads over {KVH} KV heads")
    if page_table.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"paged_decode_attention: page_table {page_table.shape}, "
                         f"context_lens {context_lens.shape}, batch {B}")
    if not (is_pow2(num_splits) and is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"num_splits={num_splits} and block_k={block_k} must be powers of two (block_k >= 16)")
    if merge not in ("pallas", "jnp"):
        raise ValueError(f"merge={merge!r}")
    group = H // KVH
    G = pow2_at_least(group, 16)
    D = pow2_at_least(hd, 16)
    n_pages = page_table.shape[1]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    page_table = page_table.astype(jnp.int32)
    context_lens = context_lens.astype(jnp.int32)

    kernel = functools.partial(
        _split_kernel, group=group, G=G, hd=hd, D=D, page_size=page_size, n_pages=n_pages,
        block_k=block_k, num_splits=num_splits, qk_scale=float(scale) * LOG2E, quantized=quantized,
        int8_convert=int8_convert, windowed=kv_start is not None)
    windowed = () if kv_start is None else (kv_start.astype(jnp.int32),)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((B, H, hd), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((B, H, num_splits, hd), f32),
                     jax.ShapeDtypeStruct((B, H, num_splits), f32))
    res = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(B, KVH, num_splits), interpret=interpret,
        name="decode_attention_split",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(layer, page_table, context_lens, *windowed, q, k_cache, v_cache, *((k_scale, v_scale) if quantized else ()))
    if num_splits == 1:
        return res
    return merge_splits(*res, q.dtype, hd, merge, interpret, context_lens=context_lens, block_k=block_k,
                        max_ctx=n_pages * page_size, kv_start=kv_start)


def merge_splits(o_part: jax.Array, lse: jax.Array, dtype, hd: int, merge: str = "pallas",
                 interpret: bool = False, *, context_lens: jax.Array, block_k: int, max_ctx: int,
                 cached_offset: int = 0, kv_start: jax.Array | None = None) -> jax.Array:
    """Kernel 2: the splits' normalised outputs o_part [B, H, S, hd] (float32) and base-2
    log-sum-exps lse [B, H, S] merged into [B, H, hd] in `dtype` (merge "jnp": the same in XLA).
    context_lens [B], block_k, max_ctx (the page table's span) and cached_offset (1 where kernel 1 split
    context_lens - 1 cached positions), and a sliding window's kv_start [B], say which splits had positions: the
    kernel reads only those."""
    B, H, num_splits, _ = o_part.shape
    if merge == "jnp":
        w = jnp.exp2(lse - jnp.max(lse, axis=2, keepdims=True))
        out = jnp.sum(o_part * w[..., None], axis=2) / jnp.sum(w, axis=2)[..., None]
        return out.astype(dtype)
    D = pow2_at_least(hd, 16)
    return pl.pallas_call(
        functools.partial(_merge_kernel, hd=hd, D=D, num_splits=num_splits, block_k=block_k, max_ctx=max_ctx,
                          cached_offset=cached_offset, windowed=kv_start is not None),
        out_shape=jax.ShapeDtypeStruct((B, H, hd), dtype), grid=(B, H), interpret=interpret,
        name="decode_attention_merge",
        compiler_params=plgpu.CompilerParams(num_warps=4 if num_splits * D >= 4096 else 2,
                                             num_stages=1),
    )(context_lens.astype(jnp.int32), *(() if kv_start is None else (kv_start.astype(jnp.int32),)), o_part, lse)


def choose_config(batch: int, kv_heads: int, span: int, kv_itemsize: int = 2, kv_int8: bool = False,
                  head_dim: int = 128) -> SplitConfig:
    """The split configuration for `batch` sequences, `kv_heads` KV heads, page tables spanning `span`,
    pages of `kv_itemsize`-byte values (1: float8, or int8 with `kv_int8`) and `head_dim` (blocks of fewer
    positions past 128: blocks.kv_block_for_head_dim)."""
    seq_heads = batch * kv_heads
    table = (tables.DECODE_ATTENTION_INT8 if kv_int8 else tables.DECODE_ATTENTION_FP8) if kv_itemsize == 1 \
        else tables.DECODE_ATTENTION
    cfg = next(c for max_sh, max_span, c in table if seq_heads <= max_sh and span <= max_span)
    cfg = dataclasses.replace(cfg, block_k=kv_block_for_head_dim(cfg.block_k, head_dim))
    # Never more splits than blocks in the span (the extra ones would only be empty programs).
    s = cfg.num_splits
    while s > 1 and s * cfg.block_k >= 2 * span:
        s //= 2
    return dataclasses.replace(cfg, num_splits=s)


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
                           page_table: jax.Array, context_lens: jax.Array, page_size: int, scale: float,
                           *, k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           config: SplitConfig | None = None, int8_convert: str | None = None,
                           window: jax.Array | int | None = None, interpret: bool = False) -> jax.Array:
    """`reference.paged_decode_attention` with the split-sequence Pallas kernels.

    q [B, H, hd]; k_cache, v_cache [L, KVH, slots, hd]; layer int32 scalar; page_table [B, P] int32;
    context_lens [B] int32 (>= 1; 0 gives zeros). Returns [B, H, hd] in q's dtype. An INT8 cache: int8 k_cache,
    v_cache with their scales k_scale, v_scale [L, KVH, slots] float32 (int8_convert: default the table's).
    `config` overrides the table (tests and benchmarks). `window`: a sliding window (int32 scalar, 0 global): only
    the last `window` positions are seen, and the blocks before them are skipped.
    """
    if config is None:
        config = choose_config(q.shape[0], k_cache.shape[1], page_table.shape[1] * page_size, k_cache.dtype.itemsize,
                               k_cache.dtype == jnp.int8, q.shape[-1])
    return paged_decode_attention_split(
        q, k_cache, v_cache, layer, page_table, context_lens, page_size, float(scale),
        num_splits=config.num_splits, block_k=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, merge=config.merge, k_scale=k_scale, v_scale=v_scale,
        int8_convert=int8_convert or tables.DECODE_ATTENTION_INT8_CONVERT,
        kv_start=None if window is None else window_start(context_lens, window), interpret=interpret)
