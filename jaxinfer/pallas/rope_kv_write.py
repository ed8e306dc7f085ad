"""Everything between the QKV projection and attention, as one kernel.

qkv [T, (H + 2K) * hd] -> per head: RMSNorm over the head (Qwen3's q_norm / k_norm), RoPE, and for
K and V heads the write into the paged caches [L, K, slots, hd] at slot_mapping[t], in place
(input_output_aliases). One program per (block of tokens, head); a head's two rotate-half halves are loaded
separately so that RoPE needs no cross-lane shuffle. cos/sin [T, hd] come from the model (computed
once per step in XLA, so the angles are bit-identical to the reference path's). With `with_kv` it also
returns the k and v it wrote, for a fresh prompt's attention (model.py), which then need not read them back.
Replaces the split/norm/rope/scatter fusions of the reference (3-5 kernels per layer) with one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.kv_cache import to_cache
from jaxinfer.pallas.blocks import head_rms_norm, layer_operands, rope_halves

f32 = jnp.float32
TOKENS_PER_PROGRAM = 8
# A program's tokens as one [BT, hd/2] tile per half (one load, one norm, one store each) instead of BT one-token
# passes, each behind the previous one's branches: the 1k prompt step's kernel took 13.5 us a layer on the H200,
# ~2.4x its bytes (seventeenth session); as tiles of 8 it took 9.7 us and the 1k raw step 13.95 -> 13.85 ms (tiles of
# 16: 13.92, 32: 14.14; eighteenth session). TILED = N: tiles of N tokens (a power of two); 0: the token loop (bench
# option rope_write_tiled). The same arithmetic per token, the norm's sums over the same halves: equal bit for bit in
# interpret mode; on the GPU the sums of squares associate otherwise along a tile's rows (float32 last bits: the
# bf16 greedy tokens of a random-weight bench model moved, the float32 GPU parity with the reference holds).
# Read by the op set (ops.pallas) when it traces a step, and passed on as `tiled`.
TILED = 8


def _unpack(refs, has_rope, has_norm, with_kv):
    """A kernel's refs after qkv: (cos, sin, q_norm, k_norm, q out, k cache out, v cache out, k out, v out)."""
    refs = list(refs)
    k_ref, v_ref = (refs.pop(), refs.pop())[::-1] if with_kv else (None, None)
    q_ref, kc_ref, vc_ref = refs[-3:]
    refs = refs[:-5]  # the aliased cache inputs (refs[-5:-3]) are the outputs kc_ref, vc_ref
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if has_rope else (None, None)
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    return cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, k_ref, v_ref


def _kernel(layer_ref, norm_layer_ref, slot_ref, qkv_ref, *refs, T, BT, H, K, hd, has_norm, has_rope, eps, with_kv):
    cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, k_ref, v_ref = _unpack(refs, has_rope, has_norm, with_kv)
    tb, h = pl.program_id(0), pl.program_id(1)
    layer, norm_layer = layer_ref[0], norm_layer_ref[0]
    half = hd // 2
    dtype = qkv_ref.dtype
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def one_token(t):
        slot = slot_ref[t]
        x1 = qkv_ref[t, pl.ds(h * hd, half)].astype(f32)
        x2 = qkv_ref[t, pl.ds(h * hd + half, half)].astype(f32)

        def norm(x1, x2, n_ref):
            return head_rms_norm(x1, x2, n_ref[norm_layer, lo], n_ref[norm_layer, hi], hd, eps, dtype)

        def rope(x1, x2):
            return rope_halves(x1, x2, cos_ref[t, lo].astype(f32), cos_ref[t, hi].astype(f32),
                               sin_ref[t, lo].astype(f32), sin_ref[t, hi].astype(f32), dtype)

        def transform(n_ref):
            y1, y2 = norm(x1, x2, n_ref) if has_norm else (x1, x2)
            if has_rope:
                return rope(y1, y2)
            return y1.astype(dtype), y2.astype(dtype)

        @pl.when(h < H)
        def _():
            y1, y2 = transform(qn_ref)
            q_ref[t, h, lo] = y1
            q_ref[t, h, hi] = y2

        @pl.when((h >= H) & (h < H + K))
        def _():
            y1, y2 = transform(kn_ref)
            kc_ref[layer, h - H, slot, lo] = to_cache(y1, kc_ref.dtype)
            kc_ref[layer, h - H, slot, hi] = to_cache(y2, kc_ref.dtype)
            if with_kv:
                k_ref[t, h - H, lo] = y1
                k_ref[t, h - H, hi] = y2

        @pl.when(h >= H + K)
        def _():
            vc_ref[layer, h - H - K, slot, lo] = to_cache(x1.astype(dtype), vc_ref.dtype)
            vc_ref[layer, h - H - K, slot, hi] = to_cache(x2.astype(dtype), vc_ref.dtype)
            if with_kv:
                v_ref[t, h - H - K, lo] = x1.astype(dtype)
                v_ref[t, h - H - K, hi] = x2.astype(dtype)

    # BT tokens per program (a static loop): one program per (token, head) made ~400k programs of
    # a few hundred bytes each for an 8k-token prefill, and their scheduling was the cost.
    for j in range(BT):
        t = tb * BT + j
        if T % BT == 0:
            one_token(t)
        else:
            pl.when(t < T)(lambda t=t: one_token(t))


def _tiled_kernel(layer_ref, norm_layer_ref, slot_ref, qkv_ref, *refs, T, BT, H, K, hd, has_norm, has_rope, eps,
                  with_kv):
    """_kernel with the program's BT tokens of head h as [BT, hd/2] tiles (TILED); tokens past T are masked."""
    cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, k_ref, v_ref = _unpack(refs, has_rope, has_norm, with_kv)
    tb, h = pl.program_id(0), pl.program_id(1)
    layer, norm_layer = layer_ref[0], norm_layer_ref[0]
    half = hd // 2
    dtype = qkv_ref.dtype
    j = jnp.arange(BT, dtype=jnp.int32)
    t = tb * BT + j
    t_ok = (t < T)[:, None]
    cols = jnp.arange(half, dtype=jnp.int32)[None, :]
    rows = jnp.minimum(t, T - 1)[:, None]   # loads: a masked token reads the last one's row
    # stores: a masked token's row and slot lie past the arrays' ends, each its own (a masked store
    # writes nothing on the GPU; interpret mode writes masked entries back, so no two may share an index)
    out_rows = t[:, None]
    slot = jnp.where(t_ok, plgpu.load(slot_ref.at[rows[:, 0]])[:, None], kc_ref.shape[2] + j[:, None])
    x1 = plgpu.load(qkv_ref.at[rows, h * hd + cols]).astype(f32)
    x2 = plgpu.load(qkv_ref.at[rows, h * hd + half + cols]).astype(f32)

    def transform(n_ref):
        y1, y2 = x1, x2
        if has_norm:
            y1, y2 = head_rms_norm(y1, y2, plgpu.load(n_ref.at[norm_layer, cols]),
                                   plgpu.load(n_ref.at[norm_layer, half + cols]), hd, eps, dtype)
        if has_rope:
            c1, c2 = (plgpu.load(cos_ref.at[rows, c0 + cols]).astype(f32) for c0 in (0, half))
            s1, s2 = (plgpu.load(sin_ref.at[rows, c0 + cols]).astype(f32) for c0 in (0, half))
            return rope_halves(y1, y2, c1, c2, s1, s2, dtype)
        return y1.astype(dtype), y2.astype(dtype)

    mask = jnp.broadcast_to(t_ok, (BT, half))

    def store(ref, index, y1, y2):
        plgpu.store(ref.at[(*index, cols)], y1, mask=mask)
        plgpu.store(ref.at[(*index, half + cols)], y2, mask=mask)

    @pl.when(h < H)
    def _():
        store(q_ref, (out_rows, h), *transform(qn_ref))

    @pl.when((h >= H) & (h < H + K))
    def _():
        y1, y2 = transform(kn_ref)
        store(kc_ref, (layer, h - H, slot), to_cache(y1, kc_ref.dtype), to_cache(y2, kc_ref.dtype))
        if with_kv:
            store(k_ref, (out_rows, h - H), y1, y2)

    @pl.when(h >= H + K)
    def _():
        y1, y2 = x1.astype(dtype), x2.astype(dtype)
        store(vc_ref, (layer, h - H - K, slot), to_cache(y1, vc_ref.dtype), to_cache(y2, vc_ref.dtype))
        if with_kv:
            store(v_ref, (out_rows, h - H - K), y1, y2)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret", "with_kv", "tiled"),
                   donate_argnames=("k_cache", "v_cache"))
def qkv_rope_write(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping, *, num_heads: int,
                   num_kv_heads: int, eps: float = 1e-6, interpret: bool = False, norm_layer=None,
                   with_kv: bool = False, tiled: int = 0):
    """qkv [T, (H+2K)*hd]; cos, sin [T, hd] or None; q_norm, k_norm [Ln, hd] or None, read at
    norm_layer (default: layer); caches [L, K, slots, hd], written at layer. Returns (q [T, H, hd],
    k_cache, v_cache), and with `with_kv` also the k and v written ([T, K, hd] each, in qkv's dtype).
    tiled: a program's tokens as tiles of that many (a power of two; 0: a loop over TOKENS_PER_PROGRAM tokens,
    also taken where hd/2 is not a power of two, which a tile's columns must be)."""
    T = qkv.shape[0]
    H, K = num_heads, num_kv_heads
    hd = qkv.shape[1] // (H + 2 * K)
    has_rope, has_norm = cos is not None, q_norm is not None
    extra = ([cos, sin] if has_rope else []) + ([q_norm, k_norm] if has_norm else [])
    args = [*layer_operands(layer, norm_layer), slot_mapping.astype(jnp.int32), qkv, *extra, k_cache, v_cache]
    n = len(args)
    if tiled and tiled & (tiled - 1):
        raise ValueError(f"qkv_rope_write: tiles of {tiled} tokens: a power of two")
    if (hd // 2) & (hd // 2 - 1):
        tiled = 0
    BT = tiled or min(TOKENS_PER_PROGRAM, T)   # a tile's rows are a power of two, the tokens past T masked
    kernel = functools.partial(_tiled_kernel if tiled else _kernel, T=T, BT=BT, H=H, K=K, hd=hd, has_norm=has_norm,
                               has_rope=has_rope, eps=eps, with_kv=with_kv)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, H, hd), qkv.dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
                  + (jax.ShapeDtypeStruct((T, K, hd), qkv.dtype),) * 2 * with_kv,
        grid=(pl.cdiv(T, BT), H + 2 * K),
        input_output_aliases={n - 2: 1, n - 1: 2},
        interpret=interpret,
        name="qkv_rope_write",
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    )(*args)
