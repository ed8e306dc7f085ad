"""Pieces shared by the kernels: block-size arithmetic (Triton tiles must be powers of two), the
precision of tile products, and reading cache slots through a page table."""

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def pow2_at_least(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def dot_precision(dtype):
    """Precision for tile products: float32 operands need HIGHEST (the Triton lowering turns DEFAULT
    into TF32, measured 4e-4 relative error on the GPU); bf16 products are exact either way."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else None


def page_slots(pt_ref, row, pos, limit, page_size: int, n_pages: int):
    """Cache slots of positions `pos` of page-table row `row`, read in place (slot 0 at pos >= limit)."""
    page_idx = jnp.minimum(pos // page_size, n_pages - 1)
    page = plgpu.load(pt_ref.at[row, page_idx], mask=pos < limit, other=0)
    return page * page_size + pos % page_size
