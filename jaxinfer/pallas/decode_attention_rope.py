"""Decode attention with the new token's norm, RoPE and cache write folded in, as Pallas Triton kernels.

`decode_attention_rope_write(qkv [B, (H + 2K) * hd], cos, sin [B, hd], q_norm, k_norm, k_cache, v_cache,
layer, slot_mapping [B], page_table [B, P], context_lens [B], ...) -> (out [B, H, hd], k_cache, v_cache)`
computes what `qkv_rope_write` followed by `paged_decode_attention` compute for one new token per
sequence (the reference twin is exactly that composition), in one kernel instead of two: a batch-1
decode step pays ~2 us of ramp and tail per dependent kernel on the H200, and the RoPE/KV-write kernel
is one of the seven per layer.

The split kernel of pallas/decode_attention.py, changed at both ends. A program (b, KV head h,
split s) loads its `group` query heads and its KV head's new k and v straight from the projection's
output, applies the per-head RMSNorm (Qwen3) and rotate-half RoPE as pallas/rope_kv_write.py does
(the same roundings), and keeps them in registers: q as two rotate-half halves, so that scores are
two half-width products (no lane shuffle). The cached positions 0..ctx-2 are split across the
programs as before; the new token (position ctx-1) is folded in by split 0 from registers, as the
initial state of its online softmax, and split 0 also writes k and v into the cache (in place,
input_output_aliases). No program reads the slot being written, so there is no race. The merge
kernel is decode_attention's.

An INT8 cache comes as two more operands, the scales k_scale and v_scale [L, K, slots] float32 (aliased in place
like the values): the cached tiles are read as pallas/decode_attention.py reads them (int8 converted exactly, the
key scales on the scores, the value scales on the probabilities), and split 0 quantizes the new k and v as
ops.quantized_cache.quantize does (rope_kv_write.quantize_vectors: scale = max|x| times 1/127, round half to even, a
zero vector scale 1), writes values and scale, and starts from the dequantized vectors, what later steps read back.
(If Triton lowers the division x / scale to the approximate PTX one, a quotient within its error of a .5 tie may
round the other way from XLA's on the GPU: tests/gpu allow one step.)

Needs hd a power of two >= 32 (`supports`); the op set falls back to the two kernels otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.numerics import to_cache
from jaxinfer.pallas.blocks import (dot_precision, head_rms_norm, is_pow2, layer_operands, online_softmax_update,
                                     page_compute_dtype, page_slots, pow2_at_least, rope_halves,
                                     to_compute)
from jaxinfer.pallas import tables
from jaxinfer.pallas.decode_attention import (LOG2E, NEG, SplitConfig, check_int8_operands, choose_config, int8_to,
                                              merge_splits, online_softmax_update_scaled, resolve_int8_convert,
                                              window_split_range, window_start)
from jaxinfer.pallas.rope_kv_write import quantize_vectors

f32 = jnp.float32


def supports(head_dim: int) -> bool:
    return is_pow2(head_dim) and head_dim >= 32


def _kernel(layer_ref, norm_layer_ref, slot_ref, pt_ref, cl_ref, qkv_ref, *refs, H, K, group, G, hd, page_size,
            n_pages, block_k, num_splits, qk_scale, has_norm, has_rope, eps, quantized, int8_convert,
            windowed=False):
    refs = list(refs)
    ws_ref = refs.pop(0) if windowed else None   # a sliding window's first position of each sequence
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if has_rope else (None, None)
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    k_ref, v_ref = refs.pop(0), refs.pop(0)        # the caches, as inputs (aliased to kc_ref, vc_ref)
    # An INT8 cache's scales, as inputs (aliased to ksc_ref, vsc_ref)
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    if quantized:
        *out_refs, kc_ref, vc_ref, ksc_ref, vsc_ref = refs
    else:
        *out_refs, kc_ref, vc_ref = refs
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, norm_layer = layer_ref[0], norm_layer_ref[0]
    ctx = jnp.minimum(plgpu.load(cl_ref.at[b]), n_pages * page_size)
    dtype = qkv_ref.dtype
    half = hd // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    rows = jnp.arange(G, dtype=jnp.int32)
    row_mask = rows < group
    hcols = jnp.arange(half, dtype=jnp.int32)
    cols = jnp.arange(hd, dtype=jnp.int32)

    # The new token: q of this KV head's query heads [G, half] x 2, and its k, v.
    def q_half(c0):
        return plgpu.load(qkv_ref.at[b, h * group + rows[:, None], c0 + hcols[None, :]],
                          mask=row_mask[:, None], other=0).astype(f32)

    q1, q2 = q_half(0), q_half(half)
    k1 = plgpu.load(qkv_ref.at[b, H + h, lo]).astype(f32)          # [half]: kept 1-D (no squeeze later)
    k2 = plgpu.load(qkv_ref.at[b, H + h, hi]).astype(f32)
    v_new = plgpu.load(qkv_ref.at[b, H + K + h, pl.ds(0, hd)])
    if has_norm:
        q1, q2 = head_rms_norm(q1, q2, qn_ref[norm_layer, lo][None, :], qn_ref[norm_layer, hi][None, :], hd, eps, dtype)
        k1, k2 = head_rms_norm(k1, k2, kn_ref[norm_layer, lo], kn_ref[norm_layer, hi], hd, eps, dtype)
    if has_rope:
        c1, c2 = cos_ref[b, lo].astype(f32), cos_ref[b, hi].astype(f32)
        s1, s2 = sin_ref[b, lo].astype(f32), sin_ref[b, hi].astype(f32)
        q1, q2 = rope_halves(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], dtype)
        k1, k2 = rope_halves(k1, k2, c1, c2, s1, s2, dtype)
    else:
        q1, q2, k1, k2 = q1.astype(dtype), q2.astype(dtype), k1.astype(dtype), k2.astype(dtype)

    # The new token as the cache holds it (a float8 cache rounds it, an int8 one quantizes it), for the write and
    # for split 0, so that this step sees what the next ones will read back.
    if quantized:
        k_sc, (kq1, kq2) = quantize_vectors([k1.astype(f32), k2.astype(f32)])
        v_sc, (vq,) = quantize_vectors([v_new.astype(f32)])
    else:
        kq1, kq2, vq = to_cache(k1, kc_ref.dtype), to_cache(k2, kc_ref.dtype), to_cache(v_new, vc_ref.dtype)

    @pl.when(s == 0)
    def _():
        slot = slot_ref[b]
        kc_ref[layer, h, slot, lo] = kq1
        kc_ref[layer, h, slot, hi] = kq2
        vc_ref[layer, h, slot, pl.ds(0, hd)] = vq
        if quantized:
            ksc_ref[layer, h, slot] = k_sc
            vsc_ref[layer, h, slot] = v_sc

    if quantized:   # dequantized as quantized_cache.read_rows reads them back
        k1, k2 = (kq1.astype(f32) * k_sc).astype(dtype), (kq2.astype(f32) * k_sc).astype(dtype)
        v_new = (vq.astype(f32) * v_sc).astype(dtype)
    elif kc_ref.dtype != dtype:
        k1, k2, v_new = kq1.astype(dtype), kq2.astype(dtype), vq.astype(dtype)

    # The cached positions 0..ctx-2, split as pallas/decode_attention.py splits them.
    cached = ctx - 1
    window_first = plgpu.load(ws_ref.at[b]) if windowed else None   # the new token is always inside the window
    start, stop = window_split_range(cached, window_first, block_k, s, num_splits)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cdt = page_compute_dtype(kc_ref.dtype, dtype)   # float8 pages: float16 products
    q1c, q2c = to_compute(q1, cdt), to_compute(q2, cdt)
    prec = dot_precision(cdt)

    def slots_of(i):
        return page_slots(pt_ref, b, i * block_k + offs, cached, page_size, n_pages, window_first)

    pad = 0 if quantized else 0.0   # a masked K/V load's value, in the pages' kind (int 0 does not cast to float8)

    def body(i, carry):
        acc, m, l, slot = carry
        valid = i * block_k + offs < cached
        if windowed:
            valid = valid & (i * block_k + offs >= window_first)
        nxt = slots_of(i + 1)
        ka = plgpu.load(k_ref.at[layer, h, slot[:, None], hcols[None, :]], mask=valid[:, None], other=pad)
        kb = plgpu.load(k_ref.at[layer, h, slot[:, None], half + hcols[None, :]], mask=valid[:, None], other=pad)
        v = plgpu.load(v_ref.at[layer, h, slot[:, None], cols[None, :]], mask=valid[:, None], other=pad)
        convert = (lambda x: int8_to(x, cdt, int8_convert)) if quantized else (lambda x: x.astype(cdt))
        ka, kb, v = convert(ka), convert(kb), convert(v)
        dims = (((1,), (1,)), ((), ()))
        sc = (jax.lax.dot_general(q1c, ka, dims, precision=prec, preferred_element_type=f32)
              + jax.lax.dot_general(q2c, kb, dims, precision=prec, preferred_element_type=f32))
        if not quantized:
            sc = jnp.where(valid[None, :], sc * qk_scale, NEG)
            return (*online_softmax_update(acc, m, l, sc, v, prec), nxt)
        k_scale = plgpu.load(ks_ref.at[layer, h, slot], mask=valid, other=0.0)   # [block_k]
        v_scale = plgpu.load(vs_ref.at[layer, h, slot], mask=valid, other=0.0)
        sc = jnp.where(valid[None, :], sc * (k_scale * qk_scale)[None, :], NEG)
        return (*online_softmax_update_scaled(acc, m, l, sc, v, v_scale, prec), nxt)

    # Split 0 starts from the new token (its score, weight 1, its value); the others from nothing.
    first = s == 0
    new_sc = (jnp.sum(q1.astype(f32) * k1.astype(f32)[None, :], axis=1)
              + jnp.sum(q2.astype(f32) * k2.astype(f32)[None, :], axis=1)) * qk_scale   # [G]
    # (Full-shape operands in each where: a scalar-bool where broadcast into arithmetic lowers to an
    # i1 + f32 add that Triton rejects.)
    m0 = jnp.where(first, new_sc, jnp.full((G,), NEG, f32))
    l0 = jnp.where(first, jnp.ones((G,), f32), jnp.zeros((G,), f32))
    acc0 = jnp.where(first, jnp.broadcast_to(v_new.astype(f32)[None, :], (G, hd)), jnp.zeros((G, hd), f32))
    acc, m, l, _ = jax.lax.fori_loop(start, stop, body, (acc0, m0, l0, slots_of(start)))

    nonempty = l > 0
    out = acc / jnp.where(nonempty, l, 1.0)[:, None]
    out_mask = row_mask[:, None]
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[b, h * group + rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=out_mask)
    else:
        o_ref, lse_ref = out_refs
        plgpu.store(o_ref.at[b, h * group + rows[:, None], s, cols[None, :]], out, mask=out_mask)
        lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG)
        plgpu.store(lse_ref.at[b, h * group + rows, s], lse, mask=row_mask)


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "num_heads", "num_kv_heads", "eps", "config",
                                             "int8_convert", "interpret"),
                   donate_argnames=("k_cache", "v_cache", "k_scale", "v_scale"))
def decode_attention_rope_write(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping, page_table,
                                context_lens, *, page_size: int, scale: float, num_heads: int, num_kv_heads: int,
                                eps: float = 1e-6, norm_layer=None, config: SplitConfig | None = None,
                                k_scale=None, v_scale=None, int8_convert: str | None = None, window=None,
                                interpret: bool = False):
    """qkv [B, (H+2K)*hd]; cos, sin [B, hd] or None; q_norm, k_norm [Ln, hd] or None (read at
    norm_layer, default layer); caches [L, K, slots, hd] (written at layer, slot_mapping [B]);
    page_table [B, P]; context_lens [B] (>= 1, counting the new token). Returns (out [B, H, hd],
    k_cache, v_cache). An INT8 cache: int8 caches with k_scale, v_scale [L, K, slots] float32 (written in place too;
    int8_convert: default tables.DECODE_ATTENTION_INT8_CONVERT); returns (out, k_cache, v_cache, k_scale, v_scale).
    window: a sliding window (int32 scalar, 0 global): the last `window` positions, the blocks before skipped."""
    B = qkv.shape[0]
    H, K = num_heads, num_kv_heads
    hd = qkv.shape[1] // (H + 2 * K)
    L, KVH, _, hd_c = k_cache.shape
    if not supports(hd) or hd_c != hd or KVH != K or H % K or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention_rope_write: qkv {qkv.shape} with {H}/{K} heads, caches {k_cache.shape}")
    int8_convert = resolve_int8_convert(int8_convert or tables.DECODE_ATTENTION_INT8_CONVERT, interpret)
    quantized = check_int8_operands("decode_attention_rope_write", k_cache, v_cache, k_scale, v_scale, int8_convert)
    if config is None:
        config = choose_config(B, K, page_table.shape[1] * page_size, k_cache.dtype.itemsize,
                               k_cache.dtype == jnp.int8, hd)
    group = H // K
    G = pow2_at_least(group, 16)
    has_rope, has_norm = cos is not None, q_norm is not None
    extra = ([cos, sin] if has_rope else []) + ([q_norm, k_norm] if has_norm else [])
    kv_start = None if window is None else window_start(context_lens, window)
    windowed = [] if kv_start is None else [kv_start]
    args = [*layer_operands(layer, norm_layer), slot_mapping.astype(jnp.int32), page_table.astype(jnp.int32),
            context_lens.astype(jnp.int32), qkv.reshape(B, H + 2 * K, hd), *windowed, *extra, k_cache, v_cache]
    caches = [k_cache, v_cache, *((k_scale, v_scale) if quantized else ())]
    args += caches[2:]
    S = config.num_splits
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((B, H, hd), qkv.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, H, S, hd), f32), jax.ShapeDtypeStruct((B, H, S), f32)]
    kernel = functools.partial(
        _kernel, H=H, K=K, group=group, G=G, hd=hd, page_size=page_size, n_pages=page_table.shape[1],
        block_k=config.block_k, num_splits=S, qk_scale=float(scale) * LOG2E, has_norm=has_norm,
        has_rope=has_rope, eps=eps, quantized=quantized, int8_convert=int8_convert, windowed=kv_start is not None)
    n = len(args)
    results = pl.pallas_call(
        kernel,
        out_shape=(*out_shape, *[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches]),
        grid=(B, K, S),
        input_output_aliases={n - len(caches) + i: len(out_shape) + i for i in range(len(caches))},
        interpret=interpret,
        name="decode_attention_rope_split",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(*args)
    res, written = results[:len(out_shape)], tuple(results[len(out_shape):])
    if S == 1:
        return res[0], *written
    merged = merge_splits(*res, qkv.dtype, hd, config.merge, interpret, context_lens=context_lens,
                          block_k=config.block_k, max_ctx=page_table.shape[1] * page_size, cached_offset=1,
                          kv_start=kv_start)
    return merged, *written
