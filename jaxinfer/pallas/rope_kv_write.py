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

from jaxinfer.numerics import to_cache
from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import head_rms_norm, layer_operands, pow2_at_least, rope_halves

f32 = jnp.float32


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
    """One program: BT tokens of head h as two [BT, P] tiles (the rotate-half halves, P = hd/2 rounded up to a power
    of two, the columns past hd/2 masked: zeros in the norm's sums); tokens past T are masked."""
    cos_ref, sin_ref, qn_ref, kn_ref, q_ref, kc_ref, vc_ref, k_ref, v_ref = _unpack(refs, has_rope, has_norm, with_kv)
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
                   with_kv: bool = False, tiled: int = tables.ROPE_KV_WRITE_TILE):
    """qkv [T, (H+2K)*hd]; cos, sin [T, hd] or None; q_norm, k_norm [Ln, hd] or None, read at
    norm_layer (default: layer); caches [L, K, slots, hd], written at layer. Returns (q [T, H, hd],
    k_cache, v_cache), and with `with_kv` also the k and v written ([T, K, hd] each, in qkv's dtype).
    tiled: a program's tokens as tiles of that many (a power of two)."""
    T = qkv.shape[0]
    H, K = num_heads, num_kv_heads
    hd = qkv.shape[1] // (H + 2 * K)
    has_rope, has_norm = cos is not None, q_norm is not None
    extra = ([cos, sin] if has_rope else []) + ([q_norm, k_norm] if has_norm else [])
    args = [*layer_operands(layer, norm_layer), slot_mapping.astype(jnp.int32), qkv, *extra, k_cache, v_cache]
    n = len(args)
    if tiled < 1 or tiled & (tiled - 1):
        raise ValueError(f"qkv_rope_write: tiles of {tiled} tokens: a power of two")
    BT = tiled   # a tile's rows; the tokens past T are masked
    kernel = functools.partial(_kernel, T=T, BT=BT, H=H, K=K, hd=hd, has_norm=has_norm, has_rope=has_rope, eps=eps,
                               with_kv=with_kv)
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
