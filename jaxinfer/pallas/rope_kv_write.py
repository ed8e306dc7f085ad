"""Everything between the QKV projection and attention, as one kernel.

qkv [T, (H + 2K) * hd] -> per head: RMSNorm over the head (Qwen3's q_norm / k_norm), RoPE, and for
K and V heads the write into the paged caches [L, K, slots, hd] at slot_mapping[t], in place
(input_output_aliases). One program per (block of tokens, head); a head's two rotate-half halves are loaded
separately so that RoPE needs no cross-lane shuffle. cos/sin [T, hd] come from the model (computed
once per step in XLA, so the angles are bit-identical to the reference path's). With `with_kv` it also
returns the k and v it wrote, for a fresh prompt's attention (model.py), which then need not read them back.
Replaces the split/norm/rope/scatter fusions of the reference (3-5 kernels per layer) with one.

An INT8 cache (ops.quantized_cache.QuantizedCache: int8 values, a float32 scale a vector) comes as the values for
the caches and two more operands, k_scale and v_scale [L, K, slots], written in place too: each token's k and v
quantized as quantized_cache.quantize does, bit for bit (`quantize_vectors`, which the fused decode kernel uses too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.numerics import to_cache
from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import head_rms_norm, layer_operands, pow2_at_least, rope_halves
from jaxinfer.pallas.decode_attention import check_int8_operands

f32 = jnp.float32
INT8_MAX = 127.0


def round_half_even(y):
    """jnp.round of float32 y (|y| < 2^23) in operations the Triton lowering has (it has no round): the integer part
    and fraction of |y| (both exact), up where the fraction passes .5 or is .5 on an odd integer. (The magic-number
    (y + 1.5 * 2^23) - 1.5 * 2^23 is folded away by XLA under jit.)"""
    a = jnp.abs(y)
    whole = jnp.floor(a)
    frac = a - whole
    odd = (whole.astype(jnp.int32) & 1) == 1
    r = jnp.where((frac > 0.5) | ((frac == 0.5) & odd), whole + 1.0, whole)
    return jnp.where(y < 0, -r, r)


def quantize_vectors(parts):
    """ops.quantized_cache.quantize of vectors given as pieces [..., n] (float32, split along the vector; zeros in
    padding columns): (scale [...], the int8 pieces). scale = max|x| times 1/127 (as quantize computes it)."""
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(p), axis=-1) for p in parts])
    scale = jnp.where(amax > 0, amax * (1.0 / INT8_MAX), 1.0)
    per = scale[..., None] if scale.ndim else scale
    return scale, [round_half_even(jnp.clip(p / per, -INT8_MAX, INT8_MAX)).astype(jnp.int8) for p in parts]


def _unpack(refs, has_rope, has_norm, with_kv, quantized):
    """A kernel's refs after qkv: (cos, sin, q_norm, k_norm, q out, k cache out, v cache out, k scale out, v scale out,
    k out, v out); the scales None but for an INT8 cache."""
    refs = list(refs)
    k_ref, v_ref = (refs.pop(), refs.pop())[::-1] if with_kv else (None, None)
    n = 4 if quantized else 2   # the aliased cache inputs come before the outputs q, caches (and scales)
    q_ref, kc_ref, vc_ref, *scale_refs = refs[-(n + 1):]
    ks_ref, vs_ref = scale_refs if quantized else (None, None)
    refs = refs[:-(2 * n + 1)]
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if has_rope else (None, None)
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    return cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, ks_ref, vs_ref, k_ref, v_ref


def _kernel(layer_ref, norm_layer_ref, slot_ref, qkv_ref, *refs, T, BT, H, K, hd, has_norm, has_rope, eps, with_kv,
            quantized):
    """One program: BT tokens of head h as two [BT, P] tiles (the rotate-half halves, P = hd/2 rounded up to a power
    of two, the columns past hd/2 masked: zeros in the norm's sums); tokens past T are masked."""
    (cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, ks_ref, vs_ref, k_ref,
     v_ref) = _unpack(refs, has_rope, has_norm, with_kv, quantized)
    tb, h = pl.program_id(0), pl.program_id(1)
    layer, norm_layer = layer_ref[0], norm_layer_ref[0]
    half = hd // 2
    P = pow2_at_least(half)
    dtype = qkv_ref.dtype
    j = jnp.arange(BT, dtype=jnp.int32)
    t = tb * BT + j
    t_ok = (t < T)[:, None]
    cols = jnp.arange(P, dtype=jnp.int32)[None, :]
    col_ok = None if P == half else cols < half
    rows = jnp.minimum(t, T - 1)[:, None]   # loads: a masked token reads the last one's row
    # stores: a masked token's row and slot lie past the arrays' ends, each its own (a masked store
    # writes nothing on the GPU; interpret mode writes masked entries back, so no two may share an index)
    out_rows = t[:, None]
    slot = jnp.where(t_ok, plgpu.load(slot_ref.at[rows[:, 0]])[:, None], kc_ref.shape[2] + j[:, None])

    def load(ref_at):   # a half's columns (padded ones read as 0)
        return plgpu.load(ref_at) if col_ok is None else plgpu.load(ref_at, mask=col_ok, other=0)

    x1 = load(qkv_ref.at[rows, h * hd + cols]).astype(f32)
    x2 = load(qkv_ref.at[rows, h * hd + half + cols]).astype(f32)

    def transform(n_ref):
        y1, y2 = x1, x2
        if has_norm:
            y1, y2 = head_rms_norm(y1, y2, load(n_ref.at[norm_layer, cols]), load(n_ref.at[norm_layer, half + cols]),
                                   hd, eps, dtype)
        if has_rope:
            c1, c2 = (load(cos_ref.at[rows, c0 + cols]).astype(f32) for c0 in (0, half))
            s1, s2 = (load(sin_ref.at[rows, c0 + cols]).astype(f32) for c0 in (0, half))
            return rope_halves(y1, y2, c1, c2, s1, s2, dtype)
        return y1.astype(dtype), y2.astype(dtype)

    mask = jnp.broadcast_to(t_ok, (BT, P)) if col_ok is None else t_ok & col_ok

    def store(ref, index, y1, y2):
        plgpu.store(ref.at[(*index, cols)], y1, mask=mask)
        plgpu.store(ref.at[(*index, half + cols)], y2, mask=mask)

    def write(c_ref, s_ref, head, y1, y2):
        """Rows y1, y2 (the halves) into a cache at the tokens' slots: rounded to its dtype, or quantized."""
        if not quantized:
            store(c_ref, (layer, head, slot), to_cache(y1, c_ref.dtype), to_cache(y2, c_ref.dtype))
            return
        scale, (a, b) = quantize_vectors([y1.astype(f32), y2.astype(f32)])
        store(c_ref, (layer, head, slot), a, b)
        plgpu.store(s_ref.at[layer, head, slot[:, 0]], scale, mask=t_ok[:, 0])

    @pl.when(h < H)
    def _():
        store(q_ref, (out_rows, h), *transform(qn_ref))

    @pl.when((h >= H) & (h < H + K))
    def _():
        y1, y2 = transform(kn_ref)
        write(kc_ref, ks_ref, h - H, y1, y2)
        if with_kv:
            store(k_ref, (out_rows, h - H), y1, y2)

    @pl.when(h >= H + K)
    def _():
        y1, y2 = x1.astype(dtype), x2.astype(dtype)
        write(vc_ref, vs_ref, h - H - K, y1, y2)
        if with_kv:
            store(v_ref, (out_rows, h - H - K), y1, y2)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret", "with_kv", "tiled"),
                   donate_argnames=("k_cache", "v_cache", "k_scale", "v_scale"))
def qkv_rope_write(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, layer, slot_mapping, *, num_heads: int,
                   num_kv_heads: int, eps: float = 1e-6, interpret: bool = False, norm_layer=None,
                   with_kv: bool = False, tiled: int = tables.ROPE_KV_WRITE_TILE, k_scale=None, v_scale=None):
    """qkv [T, (H+2K)*hd]; cos, sin [T, hd] or None; q_norm, k_norm [Ln, hd] or None, read at
    norm_layer (default: layer); caches [L, K, slots, hd], written at layer. Returns (q [T, H, hd],
    k_cache, v_cache), and with `with_kv` also the k and v written ([T, K, hd] each, in qkv's dtype, before
    rounding to the cache's). An INT8 cache: int8 caches with k_scale, v_scale [L, K, slots] float32, written too;
    returns (q, k_cache, v_cache, k_scale, v_scale[, k, v]). tiled: a program's tokens as tiles of that many (a power
    of two)."""
    T = qkv.shape[0]
    H, K = num_heads, num_kv_heads
    hd = qkv.shape[1] // (H + 2 * K)
    has_rope, has_norm = cos is not None, q_norm is not None
    extra = ([cos, sin] if has_rope else []) + ([q_norm, k_norm] if has_norm else [])
    quantized = check_int8_operands("qkv_rope_write", k_cache, v_cache, k_scale, v_scale, "cvt")
    caches = [k_cache, v_cache, *((k_scale, v_scale) if quantized else ())]
    args = [*layer_operands(layer, norm_layer), slot_mapping.astype(jnp.int32), qkv, *extra, *caches]
    n = len(args)
    if tiled < 1 or tiled & (tiled - 1):
        raise ValueError(f"qkv_rope_write: tiles of {tiled} tokens: a power of two")
    BT = tiled   # a tile's rows; the tokens past T are masked
    kernel = functools.partial(_kernel, T=T, BT=BT, H=H, K=K, hd=hd, has_norm=has_norm, has_rope=has_rope, eps=eps,
                               with_kv=with_kv, quantized=quantized)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((T, H, hd), qkv.dtype), *[jax.ShapeDtypeStruct(c.shape, c.dtype)
                                                                  for c in caches])
                  + (jax.ShapeDtypeStruct((T, K, hd), qkv.dtype),) * 2 * with_kv,
        grid=(pl.cdiv(T, BT), H + 2 * K),
        input_output_aliases={n - len(caches) + i: 1 + i for i in range(len(caches))},
        interpret=interpret,
        name="qkv_rope_write",
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    )(*args)
