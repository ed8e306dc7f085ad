"""A weight matrix stored in 8 bits, as the ops receive it.

`QuantizedWeight(values, scale, block)`: values [..., out, in] int8 or float8_e4m3fn; scale float32, one per
output channel ([..., out], block None) or one per (bo, bi) block of the matrix ([..., ceil(out / bo),
ceil(in / bi)], block (bo, bi): the format of the official FP8 checkpoints' `weight_scale_inv`). The matrix it
stands for is values * scale. Leading axes (a stack of layers) index both arrays alike, so a LayerWeight over a
stacked QuantizedWeight reads one layer's with `stacked[layer]`.

`quantize(w, fmt)` makes one from a matrix: symmetric, one scale per output channel (max |w_row| over the format's
largest value: 127 for int8, 448 for e4m3); `quantize_rows(x, dtype)` does the same for each row of activations
(W8A8). `join` concatenates quantized matrices along their output axis (the
fused Q/K/V and gate/up projections of separately quantized checkpoint tensors).
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# The stored dtype of each format, and its largest finite value (the scale maps a row's max |w| onto it).
FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
MAX_VALUE = {"int8": 127.0, "fp8": 448.0}


@flax.struct.dataclass
class QuantizedWeight:
    values: jax.Array                        # int8 / float8_e4m3fn [..., out, in]
    scale: jax.Array                         # float32 [..., out] or [..., out blocks, in blocks]
    block: tuple[int, int] | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        """The stored dtype (int8 or float8_e4m3fn)."""
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held: values and scales."""
        return self.values.nbytes + self.scale.nbytes

    def __getitem__(self, index) -> "QuantizedWeight":
        """Index the leading (layer) axes of values and scale alike."""
        return QuantizedWeight(self.values[index], self.scale[index], self.block)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """values * scale in `dtype` (products in float32)."""
        v = self.values.astype(jnp.float32)
        if self.block is None:
            w = v * self.scale[..., :, None]
        else:
            bo, bi = self.block
            out, inp = v.shape[-2:]
            s = jnp.repeat(jnp.repeat(self.scale, bo, axis=-2), bi, axis=-1)[..., :out, :inp]
            w = v * s
        return w.astype(dtype)


def format_of(dtype) -> str:
    """"int8" or "fp8": the format whose values have `dtype`."""
    for name, d in FORMATS.items():
        if jnp.dtype(d) == jnp.dtype(dtype):
            return name
    raise ValueError(f"{jnp.dtype(dtype).name} is not an 8-bit weight format ({', '.join(FORMATS)})")


@functools.partial(jax.jit, static_argnames="fmt")
def quantize(w: jax.Array, fmt: str) -> QuantizedWeight:
    """w [..., out, in] (any float dtype) in `fmt` ("int8" or "fp8"), symmetric, one float32 scale per output
    channel: scale = max |w_row| / MAX_VALUE[fmt]; values = round(w / scale) (int8: to nearest, ties to even;
    fp8: the cast's rounding). A row of zeros gets scale 1 (its values are zeros)."""
    w = w.astype(jnp.float32)
    top = MAX_VALUE[fmt]
    amax = jnp.max(jnp.abs(w), axis=-1)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = jnp.clip(w / scale[..., None], -top, top)
    if fmt == "int8":
        q = jnp.round(q)
    return QuantizedWeight(q.astype(FORMATS[fmt]), scale)


def quantize_rows(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Activations for W8A8: each row of x [T, in] in the 8-bit `dtype` (int8 or float8_e4m3fn) with its own
    float32 scale [T] (its max |x| onto the format's largest value; the max taken in x's own dtype, exact, so that no
    float32 copy of x is written; int8 rounded to nearest). x ~= values * scale[:, None]."""
    top = MAX_VALUE[format_of(dtype)]
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1).astype(jnp.float32), 1e-30)
    q = jnp.clip(x.astype(jnp.float32) * (top / amax)[:, None], -top, top)
    if jnp.dtype(dtype) == jnp.dtype(jnp.int8):
        q = jnp.round(q)
    return q.astype(dtype), amax / top


def join(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Matrices of one input width, quantized apart, as one [sum of outs, in] QuantizedWeight of the same
    values (numpy or jax arrays; exact: nothing is requantized). Per-channel scales concatenate. Block scales
    (all parts of one block (bo, bi)) concatenate along out on a grid of bo' = gcd(bo, each part's out but
    the last) rows: every part then starts on a block boundary, and each of its scale rows repeats bo / bo'
    times (bo' = bo where every part's out is a multiple of bo, as in the official Qwen3 FP8 checkpoints)."""
    if len(parts) == 1:
        return parts[0]
    xp = np if all(isinstance(p.values, np.ndarray) for p in parts) else jnp
    values = xp.concatenate([p.values for p in parts], axis=-2)
    blocks = {p.block for p in parts}
    if len(blocks) != 1:
        raise ValueError(f"cannot join matrices of different scale layouts {sorted(map(str, blocks))}")
    block = blocks.pop()
    if block is None:
        return QuantizedWeight(values, xp.concatenate([p.scale for p in parts], axis=-1))
    bo, bi = block
    sub = math.gcd(bo, *(p.shape[-2] for p in parts[:-1]))
    scales = [xp.repeat(p.scale, bo // sub, axis=-2)[..., :-(-p.shape[-2] // sub), :] for p in parts]
    return QuantizedWeight(values, xp.concatenate(scales, axis=-2), (sub, bi))
