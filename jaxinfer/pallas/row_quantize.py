"""W8A8's activations: each row of x quantized to 8 bits with a float32 scale of its own, in one kernel, and
optionally the RMSNorm before it (rms_norm then quantize: the norm's output never goes to memory).

XLA runs the row quantization (ops.quantized.quantize_rows) as a row-max reduction and a second pass that scales,
clips and casts, after the norm's own kernel when one comes before: two or three kernels of launch and latency at a
batched decode step's 8-64 rows. Here one program a row reads the row once and writes its 8-bit values and scale.

The arithmetic is quantize_rows': max |x| taken in x's dtype (exact), top / max in float32, x times that, clipped
to +-top, int8 rounded to nearest (ties to even), cast; the scale is max times 1 / top, as XLA computes max / top
(its algebraic simplifier turns a division by a constant into a product with its reciprocal, on every backend). top /
max is IEEE's division (PTX div.rn: Triton's own float division is an approximate one) and the rounding is cvt.rni,
so the scales are the bits quantize_rows gives the same row, and so are the values where XLA divides as IEEE does
(XLA:CPU; on an H100 its quantize_rows put ~0.03% of int8 values one step away, 2026-12-06). The norm is
reference.rms_norm's (the mean of squares in float32, the normed row rounded to x's dtype, then times the scale); its
sum runs in another order than XLA's, so a normed value may land a rounding step away, as in the other kernels with
a norm prologue (residual_norm.py, fused_gemv.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas.blocks import EIGHT_BIT, layer_operands, pow2_at_least

f32 = jnp.float32
i32 = jnp.int32


def _ptx(asm: str, *args: jax.Array) -> jax.Array:
    """One float32 PTX instruction ($0 the result) elementwise over float32 arguments."""
    (y,) = plgpu.elementwise_inline_asm(asm, args=list(args), constraints="=f" + ",f" * len(args), pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, f32)])
    return y


def _div(a, b, interpret: bool):
    """a / b rounded as IEEE divides (interpret mode: numpy's division, the same)."""
    return a / b if interpret else _ptx("div.rn.f32 $0, $1, $2;", a, b)


def _round(a, interpret: bool):
    """a rounded to the nearest integer, ties to even (jnp.round's rule)."""
    return jnp.round(a) if interpret else _ptx("cvt.rni.f32.f32 $0, $1;", a)


def quantized_row(x: jax.Array, dtype, top: float, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Inside a kernel: (x's values in the 8-bit dtype, its scale as a one-element float32 vector) of one row x
    [BN] (masked columns zero), with quantize_rows' arithmetic."""
    if interpret and jnp.issubdtype(x.dtype, jnp.floating):
        # XLA:CPU keeps a 16-bit product in float32 when only float32 reads it (excess precision); on the GPU the
        # row is rounded to its dtype as computed, as quantize_rows' input was
        info = jnp.finfo(x.dtype)
        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    amax = jnp.full((1,), jnp.maximum(jnp.max(jnp.abs(x)).astype(f32), 1e-30), f32)   # one-element vectors:
    top_ = jnp.full((1,), top, f32)                                                     # what the PTX takes
    q = jnp.clip(x.astype(f32) * _div(top_, amax, interpret), -top, top)
    if jnp.dtype(dtype) == jnp.int8:
        q = _round(q, interpret)
    return q.astype(dtype), amax * jnp.full((1,), np.float32(1) / np.float32(top), f32)


def _kernel(vlayer_ref, x_ref, *refs, N: int, BN: int, top: float, normed: bool, eps: float, interpret: bool):
    refs = list(refs)
    s_ref, q_ref = refs.pop(), refs.pop()
    norm_ref = refs.pop(0) if normed else None
    row = pl.program_id(0)
    cols = jnp.arange(BN, dtype=i32)    # BN: N padded to a power of two, the columns past N masked (zeros)
    ok = cols < N
    x = plgpu.load(x_ref.at[row, cols], mask=ok, other=0)
    if normed:
        h = x.astype(f32)
        h = h * jax.lax.rsqrt(jnp.sum(h * h) / N + eps)
        vlayer = plgpu.load(vlayer_ref.at[i32(0)])
        x = plgpu.load(norm_ref.at[vlayer, cols], mask=ok, other=0) * h.astype(x.dtype)
    q, scale = quantized_row(x, q_ref.dtype, top, interpret)
    plgpu.store(q_ref.at[row, cols], q, mask=ok)
    plgpu.store(s_ref.at[pl.ds(row, 1)], scale)


@functools.partial(jax.jit, static_argnames=("dtype", "top", "eps", "num_warps", "interpret"))
def row_quantize(x: jax.Array, dtype, top: float, norm_scale: jax.Array | None = None, eps: float = 1e-6,
                 vector_layer: jax.Array | int = 0, *, num_warps: int = 4,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(values [M, N] in the 8-bit `dtype`, float32 scales [M]) of the rows of x [M, N]: each row's max |x| onto
    `top` (the format's largest value: 127 for int8, 448 for e4m3), as ops.quantized.quantize_rows. With norm_scale
    ([L, N] read at vector_layer, or [N]): the rows of reference.rms_norm(x, norm_scale, eps) instead."""
    dtype = jnp.dtype(dtype)
    if dtype not in EIGHT_BIT:
        raise ValueError(f"row_quantize: the values' dtype is int8 or float8_e4m3fn, not {dtype}")
    if x.ndim != 2:
        raise ValueError(f"row_quantize: x [M, N], got {x.shape}")
    M, N = x.shape
    normed = norm_scale is not None
    if normed and norm_scale.ndim == 1:
        norm_scale, vector_layer = norm_scale[None], 0
    if normed and norm_scale.shape[-1] != N:
        raise ValueError(f"row_quantize: norm scale {norm_scale.shape} does not fit rows of {N}")
    (_, vlayer) = layer_operands(0, vector_layer)
    kernel = functools.partial(_kernel, N=N, BN=pow2_at_least(N, 16), top=float(top), normed=normed, eps=eps,
                               interpret=interpret)
    return pl.pallas_call(
        kernel, grid=(M,), interpret=interpret, name="row_quantize" + ("_norm" if normed else ""),
        out_shape=(jax.ShapeDtypeStruct((M, N), dtype), jax.ShapeDtypeStruct((M,), f32)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
    )(vlayer, x, *((norm_scale,) if normed else ()))
