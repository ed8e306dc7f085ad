"""Device side of the paged KV cache: the page arrays and the per-step index arrays.

K and V of every layer live in arrays [L, KVH, num_pages * page_size, hd]: page p holds slots
p * page_size .. (p + 1) * page_size - 1, so one page of one KV head is a contiguous
[page_size, hd] block (what attention kernels load). Page 0 is the scratch page: padding rows of a step write
there and padding entries of a page table point there, so no valid page is ever touched by padding.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig

SCRATCH_PAGE = 0


@flax.struct.dataclass
class KVCache:
    k: jax.Array                                   # [L, KVH, slots, hd]
    v: jax.Array                                   # [L, KVH, slots, hd]
    page_size: int = flax.struct.field(pytree_node=False, default=16)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2] // self.page_size

    @staticmethod
    def allocate(cfg: ModelConfig, num_pages: int, page_size: int) -> "KVCache":
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages * page_size, cfg.head_dim)
        return KVCache(jnp.zeros(shape, cfg.jnp_dtype), jnp.zeros(shape, cfg.jnp_dtype), page_size)


def bytes_per_page(cfg: ModelConfig, page_size: int) -> int:
    return 2 * cfg.num_layers * page_size * cfg.kv_size * np.dtype(cfg.jnp_dtype).itemsize


def slots_for(pages: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    """Slot indices of positions start..stop-1 of a sequence that owns `pages` (host side)."""
    pos = np.arange(start, stop)
    return np.asarray(pages, dtype=np.int32)[pos // page_size] * page_size + pos % page_size


def slot_of(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Slot of each row's position, on device: page_table [B, P], positions [B]."""
    page = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    return page * page_size + positions % page_size
