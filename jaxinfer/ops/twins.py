"""Reference twins of the fused kernels: the reference ops composed and rounded as each kernel rounds, for the
kernels' tests and benches (kernels never import ops; the twins live here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops import reference, weight
from jaxinfer.pallas.blocks import silu_mul
from jaxinfer.pallas.skinny_gemm import finish_partials


def hopper_gemm(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, epilogue: str = "none") -> jax.Array:
    """pallas.hopper_gemm's twin: the reference ops' products and residual add, the SwiGLU rounded as silu_mul
    rounds (XLA's own SwiGLU fusion keeps silu in float32 before the product)."""
    if epilogue == "residual":
        return reference.linear_residual(x, w, None, residual)
    return _gemm_epilogue(reference.linear(x, w), None, epilogue)


def hopper_gemm_w8a8(x: jax.Array, q, residual: jax.Array | None = None, epilogue: str = "none",
                     precise: bool = True) -> jax.Array:
    """pallas.hopper_gemm's W8A8 twin: XLA's W8A8 product of x's quantized rows and the 8-bit per-channel q
    (ops.pallas.xla_w8a8_product; precise: fp8 sums promoted to float32 as the kernel's are, not cuBLAS's fast
    accumulation, which the ops' own XLA path uses) rounded to x's dtype as ops.pallas rounds it, then the same
    epilogues."""
    from jaxinfer.ops.pallas import xla_w8a8_product

    return _gemm_epilogue(xla_w8a8_product(x, q, precise=precise).astype(x.dtype), residual, epilogue)


def _gemm_epilogue(y: jax.Array, residual: jax.Array | None, epilogue: str) -> jax.Array:
    """The prompt GEMM's epilogue on a rounded product: the residual added, or the SwiGLU of its halves."""
    if epilogue == "residual":
        return residual + y
    return silu_mul(*jnp.split(y, 2, axis=-1)) if epilogue == "swiglu" else y


def split_k_residual_rms_norm(partials: jax.Array, residual: jax.Array, scale: jax.Array, eps: float,
                              vector_layer: int = 0) -> tuple[jax.Array, jax.Array]:
    """pallas.residual_norm's twin: the XLA ops it replaces (skinny_gemm's split-K finish, then the reference
    norm)."""
    scale = scale if scale.ndim == 1 else scale[vector_layer]
    r = finish_partials(partials, None, residual, "residual", residual.dtype)
    return r, reference.rms_norm(r, scale, eps)


def dequantized(w) -> jax.Array:
    """The float32 [out, in] matrix an 8-bit weight (a QuantizedWeight, or a LayerWeight holding one) stands for,
    built apart from QuantizedWeight.dequantize: each value times the scale of its row, or of its (bo, bi) block."""
    q = weight(w)
    v = q.values.astype(jnp.float32)
    if q.block is None:
        return v * q.scale[:, None]
    bo, bi = q.block
    rows, cols = jnp.arange(v.shape[0]) // bo, jnp.arange(v.shape[1]) // bi
    return v * q.scale[rows[:, None], cols[None, :]]


def linear_8bit(x: jax.Array, w, b: jax.Array | None = None, *, scale: jax.Array | None = None, eps: float = 1e-6,
                residual: jax.Array | None = None, epilogue: str = "none", out_dtype=None) -> jax.Array:
    """The 8-bit variants' twin (fused_gemv, skinny_gemm with w_scale): the reference ops on the float32 dequantized
    matrix and x in float32 (the RMSNorm prologue rounded to x.dtype as reference.rms_norm rounds), the product
    rounded to x.dtype (out_dtype float32: not rounded), then the epilogue as the kernels round it."""
    h = x if scale is None else reference.rms_norm(x, scale, eps)
    y = reference.linear(h.astype(jnp.float32), dequantized(w), None if b is None else b.astype(jnp.float32))
    if out_dtype is not None:
        return y.astype(out_dtype)
    y = y.astype(x.dtype)
    if epilogue == "residual":
        return residual + y
    if epilogue == "swiglu":
        return silu_mul(*jnp.split(y, 2, axis=-1))
    return y
