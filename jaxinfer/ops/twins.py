"""Reference twins of the fused kernels: the reference ops composed and rounded as each kernel rounds, for the
kernels' tests and benches (kernels never import ops; the twins live here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.ops import reference
from jaxinfer.pallas.blocks import silu_mul
from jaxinfer.pallas.skinny_gemm import finish_partials


def hopper_gemm(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, epilogue: str = "none") -> jax.Array:
    """pallas.hopper_gemm's twin: the reference ops' products and residual add, the SwiGLU rounded as silu_mul
    rounds (XLA's own SwiGLU fusion keeps silu in float32 before the product)."""
    if epilogue == "residual":
        return reference.linear_residual(x, w, None, residual)
    if epilogue == "swiglu":
        return silu_mul(*jnp.split(reference.linear(x, w), 2, axis=-1))
    return reference.linear(x, w)


def split_k_residual_rms_norm(partials: jax.Array, residual: jax.Array, scale: jax.Array, eps: float,
                              vector_layer: int = 0) -> tuple[jax.Array, jax.Array]:
    """pallas.residual_norm's twin: the XLA ops it replaces (skinny_gemm's split-K finish, then the reference
    norm)."""
    scale = scale if scale.ndim == 1 else scale[vector_layer]
    r = finish_partials(partials, None, residual, "residual", residual.dtype)
    return r, reference.rms_norm(r, scale, eps)
