"""The INT8 KV cache's array: int8 values with one float32 scale per cached vector (one KV head at one position).

A QuantizedCache stands where a K or V cache array [L, KVH, slots, hd] stands, so the ops keep their signatures:
every read of cache rows goes through `read_rows` and every write through `write_rows`, which treat a plain array
exactly as before (a gather and a cast; `to_cache` and a scatter) and a QuantizedCache by dequantizing the gathered
rows / quantizing the written ones. Symmetric quantization, written once with the vector: scale = max|x| / 127 over
its hd values, values = round(x / scale) in [-127, 127]; a zero vector gets scale 1 and values 0.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jaxinfer.numerics import to_cache

INT8_MAX = 127.0


@flax.struct.dataclass
class QuantizedCache:
    values: jax.Array      # int8 [L, KVH, slots, hd]
    scale: jax.Array       # float32 [L, KVH, slots]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> "QuantizedCache":
        return QuantizedCache(jnp.zeros(shape, jnp.int8), jnp.ones(shape[:-1], jnp.float32))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The whole cache in `dtype` (tests and checks; the ops dequantize only the rows they read)."""
        return dequantize(self.values, self.scale, dtype)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 values [..., hd], float32 scale [...]) of vectors x [..., hd]."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    # times 1/127, not over 127: XLA's jit makes that rewrite, and the kernels then quantize bit for bit alike
    scale = jnp.where(amax > 0, amax * (1.0 / INT8_MAX), 1.0)
    values = jnp.clip(jnp.round(xf / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scale


def dequantize(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def read_rows(cache, layer, slots: jax.Array, dtype) -> jax.Array:
    """The rows of `slots` (any shape S) in the cache's `layer`, [*S, KVH, hd] in `dtype`."""
    if isinstance(cache, QuantizedCache):
        return dequantize(cache.values[layer, :, slots], cache.scale[layer, :, slots], dtype)
    return cache[layer, :, slots].astype(dtype)


def write_rows(cache, layer, slots: jax.Array, rows: jax.Array):
    """The cache with rows [T, KVH, hd] written into its `layer` at slots [T]."""
    # Two advanced indices around a slice: numpy puts the indexed dims first, so the target is [T, KVH, hd].
    if isinstance(cache, QuantizedCache):
        values, scale = quantize(rows)
        return QuantizedCache(cache.values.at[layer, :, slots].set(values), cache.scale.at[layer, :, slots].set(scale))
    return cache.at[layer, :, slots].set(to_cache(rows, cache.dtype))
