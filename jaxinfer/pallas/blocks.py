"""Pieces shared by the kernels: block-size arithmetic (Triton tiles must be powers of two), the
precision of tile products, reading cache slots through a page table, and the online-softmax
update of the attention kernels."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def pow2_divisor(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scales' shape of 8-bit values of `shape` [..., out, in]: one an output row [..., out], or one a (bo, bi)
    block [..., ceil(out / bo), ceil(in / bi)] (ops.quantized.QuantizedWeight's layouts)."""
    if block is None:
        return tuple(shape[:-1])
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def pow2_at_least(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))


# The attention kernels' tables were measured at head_dim 128. A wider head keeps a K/V block's bytes (the Triton
# pipeline's shared-memory buffers, num_stages of them) by taking fewer positions a block: at Gemma 3's 256 the prompt
# kernel's table config asked 280 KB of the H200's 227 KB.
TABLE_HEAD_DIM = 128


def kv_block_for_head_dim(block_k: int, head_dim: int, lo: int = 16) -> int:
    """block_k for K/V tiles of `head_dim`: the table's (measured at head_dim 128), scaled down for wider heads."""
    if head_dim <= TABLE_HEAD_DIM:
        return block_k
    return max(lo, block_k * TABLE_HEAD_DIM // pow2_at_least(head_dim))


F16_MAX = 65504.0


def page_compute_dtype(cache_dtype, dtype):
    """The dtype an attention kernel multiplies cached pages in. Float8 pages with bf16 queries go
    through float16: on Hopper e4m3 -> f16 is one instruction and e4m3 -> bf16 is not (measured: the
    float8 kernel at B128 113.5 -> 88.0 us). f16 holds every e4m3 value and every bf16 query of
    magnitude 6e-5 .. 65504 exactly (queries are clipped to that range); the probabilities are rounded
    to f16 rather than bf16 (finer). Otherwise `dtype`."""
    if jnp.dtype(cache_dtype).itemsize == 1 and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        return jnp.float16
    return dtype


def to_compute(x, dtype):
    """x in a kernel's compute dtype (float16: clipped to its finite range first)."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16) and x.dtype != jnp.float16:
        return jnp.clip(x.astype(jnp.float32), -F16_MAX, F16_MAX).astype(dtype)
    return x.astype(dtype)


def dot_precision(dtype):
    """Precision for tile products: float32 operands need HIGHEST (the Triton lowering turns DEFAULT
    into TF32, measured 4e-4 relative error on the GPU); bf16 products are exact either way."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.dtype(jnp.float32) else None


def row_tiles(n: int, block: int):
    """(index, mask) of each [block] tile of a row of n: a slice, then for a last tile past n the columns as an
    index array with their mask (else None). The decode GEMVs walk rows so (fused_gemv)."""
    lanes = jnp.arange(block)
    for k0 in range(0, n, block):
        if k0 + block > n:
            cols = k0 + lanes
            yield cols, cols < n
        else:
            yield pl.ds(k0, block), None


def silu_mul(gate, up):
    """silu(gate) * up, rounded as the kernels' epilogues round: silu in float32, rounded to up's
    dtype, then the product (in that dtype)."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(up.dtype) * up


def tile_mask(row_ok, col_ok, shape):
    """The mask of a [rows, cols] tile load from optional row and column masks (None: all valid);
    None when neither is given."""
    if row_ok is None and col_ok is None:
        return None
    if row_ok is None:
        return jnp.broadcast_to(col_ok[None, :], shape)
    if col_ok is None:
        return jnp.broadcast_to(row_ok[:, None], shape)
    return row_ok[:, None] & col_ok[None, :]


# The 8-bit formats' dtypes (int8, e4m3) that the kernels take for weights, W8A8 rows and caches
EIGHT_BIT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def zero_fill(dtype):
    """A masked load's fill value for `dtype`: 0.0 for float8 (the lowering casts no integer to float8), else 0."""
    return 0.0 if dtype == jnp.float8_e4m3fn else 0


def page_slots(pt_ref, row, pos, limit, page_size: int, n_pages: int, first=None):
    """Cache slots of positions `pos` of page-table row `row`, read in place (slot 0 at pos >= limit, and with a
    sliding window's `first` position below it: its pages may have been freed, their table entries are not read)."""
    page_idx = jnp.minimum(pos // page_size, n_pages - 1)
    inside = pos < limit if first is None else (pos < limit) & (pos >= first)
    page = plgpu.load(pt_ref.at[row, page_idx], mask=inside, other=0)
    return page * page_size + pos % page_size


def split_range(n_blocks, split, num_splits: int):
    """Blocks [start, stop) of split `split` when n_blocks are shared out over num_splits programs
    (each takes ceil(n_blocks / num_splits); the last ones may get fewer or none)."""
    if num_splits == 1:
        return jnp.int32(0), n_blocks
    per_split = (n_blocks + num_splits - 1) // num_splits
    start = split * per_split
    return start, jnp.minimum(start + per_split, n_blocks)


def head_rms_norm(x1, x2, w1, w2, hd: int, eps: float, dtype):
    """RMSNorm of heads held as rotate-half halves x1, x2 [..., hd/2] (float32) with weight halves
    w1, w2, rounded as reference.rms_norm rounds: normalised in float32, rounded to dtype, times
    the weight. Returns float32 halves holding dtype values."""
    f32 = jnp.float32
    keep = x1.ndim > 1          # one head as 1-D halves: a scalar sum
    inv = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=-1, keepdims=keep) + jnp.sum(x2 * x2, axis=-1, keepdims=keep))
                        / hd + eps)
    r = lambda x, w: ((x * inv).astype(dtype).astype(f32) * w.astype(f32)).astype(dtype).astype(f32)
    return r(x1, w1), r(x2, w2)


def rope_halves(x1, x2, c1, c2, s1, s2, dtype):
    """Rotate-half RoPE on halves (float32 in), rounded to dtype."""
    return (x1 * c1 - x2 * s1).astype(dtype), (x2 * c2 + x1 * s2).astype(dtype)


def online_softmax_update(acc, m, l, sc, v, prec):
    """Fold one block of base-2 scores sc [M, block_k] (masked entries very negative) and its values
    v [block_k, D] into the running max m [M], sum l [M] and float32 accumulator acc [M, D]."""
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    p, acc = p.astype(v.dtype), acc * alpha[:, None]
    return acc + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=prec,
                                     preferred_element_type=jnp.float32), m_new, l


def layer_operands(layer, vector_layer=None) -> tuple[jax.Array, jax.Array]:
    """([layer], [vector_layer]) as two one-entry int32 operands (the same one twice when vector_layer is None).

    Never one [2] array: a traced index becomes [1] by a free reshape, and a constant one (an unrolled layer's)
    stays a literal, but XLA turns a [2] pair of constants into a parameterless fusion (an iota times i, a
    broadcast) that runs as a kernel of its own, inside the decode loop, every step: 37 of them a batch-1
    Qwen3-4B step on the H200 (its optimized HLO), ~0.8 us each."""
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    return layer, layer if vector_layer is None else jnp.asarray(vector_layer, jnp.int32).reshape(1)


def run_mosaic(call, *args, interpret: bool = False):
    """Call a Mosaic GPU kernel (plgpu.kernel's function) on args, in Mosaic GPU's interpret mode when asked (the CPU
    tests)."""
    if not interpret:
        return call(*args)
    from jax.experimental.pallas import mosaic_gpu

    with mosaic_gpu.force_gpu_interpret_mode():
        return call(*args)


# How the kernels turn int8 values into floats, all exact (fused_gemv.weights_to_f32, decode_attention.int8_to):
# "cvt" the conversion instruction, "bits" integer adds into a float's mantissa, "prmt" byte permutes (inline PTX).
INT8_CONVERTS = ("cvt", "bits", "prmt")


def resolve_int8_convert(int8_convert: str, interpret: bool) -> str:
    """The conversion a kernel compiles: "prmt" (inline PTX) runs as "cvt" in interpret mode (the same values)."""
    return "cvt" if interpret and int8_convert == "prmt" else int8_convert


def int8_bits_to_f32(x: jax.Array) -> jax.Array:
    """int8 -> float32 exactly by "bits": v + 128 (0..255) in the low mantissa bits of 2^23, then 2^23 + 128
    subtracted: integer adds and one float subtraction."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32) + 0x4B000080, jnp.float32) - 8388736.0
