"""Decode attention with the new token's norm, RoPE and cache write folded in, as Pallas Triton kernels.

`decode_attention_rope_write(qkv [B, (H + 2K) * hd], cos, sin [B, hd], q_norm, k_norm, k_cache, v_cache,
layer, slot_mapping [B], page_table [B, P], context_lens [B], ...) -> (out [B, H, hd], k_cache, v_cache)`
computes what `qkv_rope_write` followed by `paged_decode_attention` compute for one new token per
sequence (the reference twin is exactly that composition), in one kernel instead of two: a batch-1
decode step pays ~2 us of ramp and tail per dependent kernel on the H200 (bench/NOTES.md, fourth
session), and the RoPE/KV-write kernel is one of the seven per layer.

The split kernel of pallas/decode_attention.py, changed at both ends. A program (b, KV head h,
split s) loads its `group` query heads and its KV head's new k and v straight from the projection's
output, applies the per-head RMSNorm (Qwen3) and rotate-half RoPE as pallas/rope_kv_write.py does
(the same roundings), and keeps them in registers: q as two rotate-half halves, so that scores are
two half-width products (no lane shuffle). The cached positions 0..ctx-2 are split across the
programs as before; the new token (position ctx-1) is folded in by split 0 from registers, as the
initial state of its online softmax, and split 0 also writes k and v into the cache (in place,
input_output_aliases). No program reads the slot being written, so there is no race. The merge
kernel is decode_attention's; with `SplitConfig(merge="last")` there is none: each program adds one to its
(sequence, KV head)'s counter after its partial is stored, and the one that completes a multiple of num_splits
merges every split's partial and writes the output (the pattern bench/kernels_barrier.py checked on the H200).
The counters are threaded state (`decode_attention_rope_write_counted`): zeros once a step, passed from layer to
layer; they count modulo num_splits, so nothing resets them between calls.

Needs hd a power of two >= 32 (`supports`); the op set falls back to the two kernels otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kv_cache import to_cache
from jaxinfer.pallas.blocks import (dot_precision, head_rms_norm, is_pow2, layer_operands, online_softmax_update,
                                     page_compute_dtype, page_slots, pow2_at_least, rope_halves, split_range,
                                     to_compute)
from jaxinfer.pallas.decode_attention import LOG2E, NEG, SplitConfig, choose_config, merge_splits

f32 = jnp.float32


def supports(head_dim: int) -> bool:
    return is_pow2(head_dim) and head_dim >= 32


def _kernel(layer_ref, norm_layer_ref, slot_ref, pt_ref, cl_ref, qkv_ref, *refs, H, K, group, G, hd, page_size,
            n_pages, block_k, num_splits, qk_scale, has_norm, has_rope, eps, merge_last, interpret):
    refs = list(refs)
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if has_rope else (None, None)
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    k_ref, v_ref = refs.pop(0), refs.pop(0)        # the caches, as inputs (aliased to kc_ref, vc_ref)
    cnt_ref = refs.pop() if merge_last else None   # the counters (the input aliased to this output)
    if merge_last:
        refs.pop(0)
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

    # The new token as the cache holds it (a float8 cache rounds it), for the write and for split 0,
    # so that this step sees what the next ones will read back.
    kq1, kq2, vq = to_cache(k1, kc_ref.dtype), to_cache(k2, kc_ref.dtype), to_cache(v_new, vc_ref.dtype)

    @pl.when(s == 0)
    def _():
        slot = slot_ref[b]
        kc_ref[layer, h, slot, lo] = kq1
        kc_ref[layer, h, slot, hi] = kq2
        vc_ref[layer, h, slot, pl.ds(0, hd)] = vq

    if kc_ref.dtype != dtype:
        k1, k2, v_new = kq1.astype(dtype), kq2.astype(dtype), vq.astype(dtype)

    # The cached positions 0..ctx-2, split as pallas/decode_attention.py splits them.
    cached = ctx - 1
    start, stop = split_range(pl.cdiv(cached, block_k), s, num_splits)
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cdt = page_compute_dtype(kc_ref.dtype, dtype)   # float8 pages: float16 products
    q1c, q2c = to_compute(q1, cdt), to_compute(q2, cdt)
    prec = dot_precision(cdt)

    def slots_of(i):
        return page_slots(pt_ref, b, i * block_k + offs, cached, page_size, n_pages)

    def body(i, carry):
        acc, m, l, slot = carry
        valid = i * block_k + offs < cached
        nxt = slots_of(i + 1)
        ka = plgpu.load(k_ref.at[layer, h, slot[:, None], hcols[None, :]], mask=valid[:, None], other=0.0)
        kb = plgpu.load(k_ref.at[layer, h, slot[:, None], half + hcols[None, :]], mask=valid[:, None], other=0.0)
        v = plgpu.load(v_ref.at[layer, h, slot[:, None], cols[None, :]], mask=valid[:, None], other=0.0).astype(cdt)
        dims = (((1,), (1,)), ((), ()))
        sc = (jax.lax.dot_general(q1c, ka.astype(cdt), dims, precision=prec, preferred_element_type=f32)
              + jax.lax.dot_general(q2c, kb.astype(cdt), dims, precision=prec, preferred_element_type=f32))
        sc = jnp.where(valid[None, :], sc * qk_scale, NEG)
        return (*online_softmax_update(acc, m, l, sc, v, prec), nxt)

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
        o_ref, lse_ref, *final_ref = out_refs
        plgpu.store(o_ref.at[b, h * group + rows[:, None], s, cols[None, :]], out, mask=out_mask)
        lse = jnp.where(nonempty, m + jnp.log2(jnp.where(nonempty, l, 1.0)), NEG)
        plgpu.store(lse_ref.at[b, h * group + rows, s], lse, mask=row_mask)
        if merge_last:
            _merge_if_last(cnt_ref, o_ref, lse_ref, final_ref[0], b, h, K=K, group=group, hd=hd, cached=cached,
                           block_k=block_k, num_splits=num_splits, interpret=interpret)


MERGE_CHUNK = 16   # splits a merging program loads at once ([group, 16, hd] float32: 64 registers a thread at hd 128)


def _merge_if_last(cnt_ref, o_ref, lse_ref, out_ref, b, h, *, K, group, hd, cached, block_k, num_splits, interpret):
    """After this program's partial is stored: count it in; the program that completes the (sequence, KV head)'s
    num_splits merges all of them into out_ref, as decode_attention's merge kernel does (max lse, 2^(lse - max)
    weights, the weighted sum over the weights' sum), over the live splits (a prefix) in chunks of MERGE_CHUNK."""
    i32 = jnp.int32
    load_kw = {} if interpret else {"volatile": True}   # other programs' stores: read through L2, never L1
    if not interpret:
        plgpu.debug_barrier()   # every thread's stores of the partial before the one atomic (bar.sync)
    counter = (b * K + h,)
    old = plgpu.atomic_add(cnt_ref, counter, i32(1))

    @pl.when((old & (num_splits - 1)) == num_splits - 1)
    def _():
        acquire = plgpu.atomic_add(cnt_ref, counter, i32(0))
        zero = acquire - acquire   # the loads below depend on the acquire, so none can be issued before it
        Gp = pow2_at_least(group)
        C = min(num_splits, MERGE_CHUNK)
        g = jnp.arange(Gp, dtype=i32)
        heads = h * group + jnp.minimum(g, group - 1)   # padding rows read a real head's row, never stored
        splits = jnp.arange(num_splits, dtype=i32)
        start, stop = split_range(pl.cdiv(cached, block_k), splits, num_splits)
        live = (start < stop) | (splits == 0)
        n_live = jnp.sum(live.astype(i32))
        lse_all = plgpu.load(lse_ref.at[b, heads[:, None], splits[None, :] + zero],
                             mask=jnp.broadcast_to(live[None, :], (Gp, num_splits)), other=NEG, **load_kw)
        top = jnp.max(lse_all, axis=1)                                                 # [Gp]
        w_sum = jnp.sum(jnp.exp2(lse_all - top[:, None]), axis=1)
        cols = jnp.arange(hd, dtype=i32)
        j = jnp.arange(C, dtype=i32)

        def chunk(c, acc):
            sp = c * C + j + zero
            ok = jnp.broadcast_to((sp < n_live)[None, :], (Gp, C))
            w = jnp.exp2(plgpu.load(lse_ref.at[b, heads[:, None], sp[None, :]], mask=ok, other=NEG, **load_kw)
                         - top[:, None])                                               # [Gp, C]
            o = plgpu.load(o_ref.at[b, heads[:, None, None], sp[None, :, None], cols[None, None, :]],
                           mask=jnp.broadcast_to(ok[:, :, None], (Gp, C, hd)), other=0.0, **load_kw)
            return acc + jnp.sum(o * w[:, :, None], axis=1)

        acc = jax.lax.fori_loop(0, pl.cdiv(n_live, C), chunk, jnp.zeros((Gp, hd), f32))
        plgpu.store(out_ref.at[b, heads[:, None], cols[None, :]], (acc / w_sum[:, None]).astype(out_ref.dtype),
                    mask=jnp.broadcast_to((g < group)[:, None], (Gp, hd)))


def decode_attention_rope_write(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping, page_table,
                                context_lens, *, page_size: int, scale: float, num_heads: int, num_kv_heads: int,
                                eps: float = 1e-6, norm_layer=None, config: SplitConfig | None = None,
                                interpret: bool = False):
    """qkv [B, (H+2K)*hd]; cos, sin [B, hd] or None; q_norm, k_norm [Ln, hd] or None (read at
    norm_layer, default layer); caches [L, K, slots, hd] (written at layer, slot_mapping [B]);
    page_table [B, P]; context_lens [B] (>= 1, counting the new token). Returns (out [B, H, hd],
    k_cache, v_cache). A merge by the last split (config.merge "last") counts in fresh zeros."""
    counters = jnp.zeros((qkv.shape[0] * num_kv_heads,), jnp.int32)
    return decode_attention_rope_write_counted(
        qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping, page_table, context_lens, counters,
        page_size=page_size, scale=scale, num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
        norm_layer=norm_layer, config=config, interpret=interpret)[:3]


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "num_heads", "num_kv_heads", "eps", "config",
                                             "interpret"), donate_argnames=("k_cache", "v_cache", "counters"))
def decode_attention_rope_write_counted(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping,
                                        page_table, context_lens, counters, *, page_size: int, scale: float,
                                        num_heads: int, num_kv_heads: int, eps: float = 1e-6, norm_layer=None,
                                        config: SplitConfig | None = None, interpret: bool = False):
    """decode_attention_rope_write threading the merge's counters [B * K] int32 (zeros before a step's first
    call; each call leaves them at multiples of its num_splits). Returns (out, k_cache, v_cache, counters);
    the counters pass through untouched unless the config merges by the last split."""
    B = qkv.shape[0]
    H, K = num_heads, num_kv_heads
    hd = qkv.shape[1] // (H + 2 * K)
    L, KVH, _, hd_c = k_cache.shape
    if not supports(hd) or hd_c != hd or KVH != K or H % K or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention_rope_write: qkv {qkv.shape} with {H}/{K} heads, caches {k_cache.shape}")
    if counters.shape != (B * K,) or counters.dtype != jnp.int32:
        raise ValueError(f"decode_attention_rope_write: counters {counters.shape} {counters.dtype}, want ({B * K},) "
                         f"int32")
    if config is None:
        config = choose_config(B, K, page_table.shape[1] * page_size, k_cache.dtype.itemsize)
    group = H // K
    G = pow2_at_least(group, 16)
    S = config.num_splits
    merge_last = S > 1 and config.merge == "last"
    has_rope, has_norm = cos is not None, q_norm is not None
    extra = ([cos, sin] if has_rope else []) + ([q_norm, k_norm] if has_norm else [])
    args = [*layer_operands(layer, norm_layer), slot_mapping.astype(jnp.int32), page_table.astype(jnp.int32),
            context_lens.astype(jnp.int32), qkv.reshape(B, H + 2 * K, hd), *extra, k_cache, v_cache]
    args += [counters] * merge_last
    n = len(args)
    if S == 1:
        out_shape = [jax.ShapeDtypeStruct((B, H, hd), qkv.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, H, S, hd), f32), jax.ShapeDtypeStruct((B, H, S), f32)]
        out_shape += [jax.ShapeDtypeStruct((B, H, hd), qkv.dtype)] * merge_last
    caches = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    c0 = n - 2 - merge_last   # the caches' input positions
    aliases = {c0: len(out_shape), c0 + 1: len(out_shape) + 1}
    if merge_last:
        caches.append(jax.ShapeDtypeStruct(counters.shape, counters.dtype))
        aliases[n - 1] = len(out_shape) + 2
    kernel = functools.partial(
        _kernel, H=H, K=K, group=group, G=G, hd=hd, page_size=page_size, n_pages=page_table.shape[1],
        block_k=config.block_k, num_splits=S, qk_scale=float(scale) * LOG2E, has_norm=has_norm,
        has_rope=has_rope, eps=eps, merge_last=merge_last, interpret=interpret)
    res = pl.pallas_call(
        kernel,
        out_shape=(*out_shape, *caches),
        grid=(B, K, S),
        input_output_aliases=aliases,
        interpret=interpret,
        name="decode_attention_rope_split",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(*args)
    if merge_last:
        *_, out, k_cache, v_cache, counters = res
        return out, k_cache, v_cache, counters
    *res, k_cache, v_cache = res
    if S == 1:
        return res[0], k_cache, v_cache, counters
    merged = merge_splits(*res, qkv.dtype, hd, config.merge, interpret, context_lens=context_lens,
                          block_k=config.block_k, max_ctx=page_table.shape[1] * page_size, cached_offset=1)
    return merged, k_cache, v_cache, counters
