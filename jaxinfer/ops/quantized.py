"""A weight matrix stored in 8 bits, as the ops receive it.

`QuantizedWeight(values, scale, block)`: values [..., out, in] int8 or float8_e4m3fn; scale float32, one per
output channel ([..., out], block None) or one per (bo, bi) block of the matrix ([..., ceil(out / bo),
ceil(in / bi)], block (bo, bi): the format of the official FP8 checkpoints' `weight_scale_inv`). The matrix it
stands for is values * scale. Leading axes (a stack of layers) index both arrays alike, so a LayerWeight over a
stacked QuantizedWeight reads one layer's with `stacked[layer]`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


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
