"""A split-K projection's finish fused with the RMSNorm that follows it: (residual, normed) in one kernel.

At batch 8-64 the attention's output projection (N = 2,560 on Qwen3-4B) runs as a split-K skinny GEMM
that writes float32 partial sums [S, M, N]. XLA then ran two kernels: the finish (sum the partials,
round, add the residual: 1.7 us on the H200 at batch 8) and the MLP's RMSNorm of that sum (2.4 us),
each mostly launch and latency (the rows are 5 KB). Here one program per row reads its S partial rows
and its residual row once, and writes the new residual row and its normed row.

Rounding follows the ops it replaces: the partials summed in order in float32 (skinny_gemm.finish_partials),
rounded to the residual's dtype, added to the residual (rounded again), then reference.rms_norm (the
mean of squares in float32, the normed row rounded, then times the scale); ops.twins.split_k_residual_rms_norm
is that composition.

With `quantize_to` (an 8-bit dtype and its largest value), the normed row leaves quantized for a W8A8 product, as
row_quantize.py quantizes it (values and a float32 scale a row), instead of in the activations' dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas.blocks import EIGHT_BIT, layer_operands, pow2_at_least
from jaxinfer.pallas.row_quantize import quantized_row

f32 = jnp.float32
i32 = jnp.int32


def _kernel(vlayer_ref, p_ref, res_ref, scale_ref, r_ref, h_ref, *hs_ref, S: int, N: int, BN: int, eps: float,
            top: float | None = None, interpret: bool = False):
    row = pl.program_id(0)
    vlayer = plgpu.load(vlayer_ref.at[i32(0)])
    cols = jnp.arange(BN, dtype=i32)    # BN: N padded to a power of two, the columns past N masked
    ok = cols < N
    load = lambda ref, *lead: plgpu.load(ref.at[(*lead, cols)], mask=ok, other=0)
    y = load(p_ref, i32(0), row)
    for s in range(1, S):
        y = y + load(p_ref, i32(s), row)
    r = load(res_ref, row) + y.astype(r_ref.dtype)
    h = r.astype(f32)
    h = h * jax.lax.rsqrt(jnp.sum(h * h) / N + eps)     # masked columns are 0: the sum is the row's
    h = load(scale_ref, vlayer) * h.astype(r_ref.dtype)
    plgpu.store(r_ref.at[row, cols], r, mask=ok)
    if top is None:
        plgpu.store(h_ref.at[row, cols], h.astype(h_ref.dtype), mask=ok)
        return
    q, h_scale = quantized_row(h, h_ref.dtype, top, interpret)
    plgpu.store(h_ref.at[row, cols], q, mask=ok)
    plgpu.store(hs_ref[0].at[pl.ds(row, 1)], h_scale)


@functools.partial(jax.jit, static_argnames=("eps", "quantize_to", "num_warps", "interpret"))
def split_k_residual_rms_norm(partials: jax.Array, residual: jax.Array, scale: jax.Array, eps: float,
                              vector_layer: jax.Array | int = 0, *, quantize_to: tuple | None = None,
                              num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, ...]:
    """partials [S, M, N] float32, residual [M, N], scale [L, N] (or [N]) read at `vector_layer`:
    (r, rms_norm(r, scale[vector_layer], eps)) with r = residual + round(sum of the partials). quantize_to = (8-bit
    dtype, its largest value): (r, the normed rows' 8-bit values, their float32 scales [M]) instead."""
    if scale.ndim == 1:
        scale, vector_layer = scale[None], 0
    S, M, N = partials.shape
    if residual.shape != (M, N) or scale.shape[-1] != N:
        raise ValueError(f"split_k_residual_rms_norm: partials {partials.shape}, residual {residual.shape} and "
                         f"scale {scale.shape} disagree")
    h_dtype = jax.eval_shape(lambda s, x: s * x, jax.ShapeDtypeStruct((), scale.dtype),
                             jax.ShapeDtypeStruct((), residual.dtype)).dtype
    out_shape = [jax.ShapeDtypeStruct((M, N), residual.dtype), jax.ShapeDtypeStruct((M, N), h_dtype)]
    top = None
    if quantize_to is not None:
        q_dtype, top = jnp.dtype(quantize_to[0]), float(quantize_to[1])
        if q_dtype not in EIGHT_BIT:
            raise ValueError(f"split_k_residual_rms_norm: quantize_to an 8-bit dtype, not {q_dtype}")
        out_shape[1:] = [jax.ShapeDtypeStruct((M, N), q_dtype), jax.ShapeDtypeStruct((M,), f32)]
    (_, vlayer) = layer_operands(0, vector_layer)
    kernel = functools.partial(_kernel, S=S, N=N, BN=pow2_at_least(N, 16), eps=eps, top=top, interpret=interpret)
    return pl.pallas_call(
        kernel, grid=(M,), interpret=interpret,
        name="split_k_residual_rms_norm" + ("_quantize" if top is not None else ""), out_shape=tuple(out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
    )(vlayer, partials, residual, scale)

