"""Dtype rules shared by every layer (model, ops, kernels): imports nothing of the package."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_float8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def to_cache(x: jax.Array, dtype) -> jax.Array:
    """x as stored in a cache of `dtype`: float8 clipped to its finite range first (e4m3 has no
    infinity: an overflowing cast gives NaN). Also usable inside Pallas kernels."""
    if is_float8(dtype):
        big = float(jnp.finfo(dtype).max)
        return jnp.clip(x.astype(jnp.float32), -big, big).astype(dtype)
    return x.astype(dtype)
