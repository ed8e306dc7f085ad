"""Device side of the paged KV cache: the page arrays and the per-step index arrays.

K and V of every layer live in arrays [L, KVH, num_pages * page_size, hd]: page p holds slots
p * page_size .. (p + 1) * page_size - 1, so one page of one KV head is a contiguous
[page_size, hd] block (what attention kernels load). Page 0 is the scratch page: padding rows of a step write
there and padding entries of a page table point there, so no valid page is ever touched by padding.

The cache is kept in the model's dtype, or in float8 (e4m3, `kv_cache_dtype="fp8"`, as vLLM's
`--kv-cache-dtype fp8`): half the bytes, so twice the tokens in the pool and half the KV reads of a
decode step, for a 3-bit mantissa. Values are stored unscaled, clipped to e4m3's +-448 (a plain cast
would turn them into NaN); every writer goes through `to_cache` and every reader casts back to the
compute dtype.

Or in int8 (`kv_cache_dtype="int8"`): each cached vector (one KV head at one position) as int8 values with a float32
scale of its own, written once with it (ops.quantized_cache.QuantizedCache in place of the k and v arrays): hd + 4
bytes a vector, about half of 16 bits', with a finer grid than e4m3's for vectors without outliers.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.numerics import is_float8, to_cache  # noqa: F401  (the cache's dtype rules live there)
from jaxinfer.ops.quantized_cache import QuantizedCache

SCRATCH_PAGE = 0


KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "int8": jnp.int8}


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def kv_cache_dtype(cfg: ModelConfig, name: str = "auto"):
    """The cache's dtype for a `kv_cache_dtype` option: "auto" (the model's dtype), "fp8" or "int8" (scaled)."""
    check_kv_cache_dtype(name)
    return KV_CACHE_DTYPES[name] or cfg.jnp_dtype


@flax.struct.dataclass
class KVCache:
    k: jax.Array                                   # [L, KVH, slots, hd] (or a QuantizedCache of that shape)
    v: jax.Array                                   # [L, KVH, slots, hd] (or a QuantizedCache of that shape)
    page_size: int = flax.struct.field(pytree_node=False, default=16)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2] // self.page_size

    @staticmethod
    def allocate(cfg: ModelConfig, num_pages: int, page_size: int, dtype=None) -> "KVCache":
        """dtype: the cache's (default the model's; see kv_cache_dtype); int8: QuantizedCaches."""
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages * page_size, cfg.head_dim)
        dtype = dtype or cfg.jnp_dtype
        if jnp.dtype(dtype) == jnp.int8:
            return KVCache(QuantizedCache.zeros(shape), QuantizedCache.zeros(shape), page_size)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), page_size)


def bytes_per_page(cfg: ModelConfig, page_size: int, dtype=None) -> int:
    """K and V bytes of one page in all layers; int8 counts each vector's float32 scale."""
    per_vector = cfg.head_dim * np.dtype(dtype or cfg.jnp_dtype).itemsize
    if np.dtype(dtype or cfg.jnp_dtype) == np.int8:
        per_vector += 4
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * per_vector


def slots_for(pages: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    """Slot indices of positions start..stop-1 of a sequence that owns `pages` (host side)."""
    pos = np.arange(start, stop)
    return np.asarray(pages, dtype=np.int32)[pos // page_size] * page_size + pos % page_size


def slot_of(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Slot of each row's position, on device: page_table [B, P], positions [B]."""
    page = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    return page * page_size + positions % page_size
