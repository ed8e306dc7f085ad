"""The op interface. `get_ops(name)` returns a namespace of ops with the signatures of ops.reference:
"reference" (jax.numpy), "pallas" (Pallas GPU kernels where they measured faster: ops/pallas.py) and
"pallas-interpret" (the same kernels in Pallas interpret mode, for CPU tests).

Weight matrices of a layer reach the ops as `LayerWeight`s: the stacked [L, out, in] array and the
layer index, so that a kernel reads the layer's rows in place. (Slicing the stack first would make
XLA copy the slice into a buffer of its own before a custom call: twice the bytes of a decode step.)
"""

import dataclasses
import functools

import jax


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    stacked: jax.Array   # [L, out, in], or a stacked ops.quantized.QuantizedWeight (get() gives its layer's)
    layer: jax.Array     # int32 scalar

    def get(self) -> jax.Array:
        return self.stacked[self.layer]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype


def weight(w) -> jax.Array:
    """The [out, in] matrix of a LayerWeight (a QuantizedWeight where it holds one), or w itself."""
    return w.get() if isinstance(w, LayerWeight) else w


@functools.cache
def get_ops(name: str = "reference"):
    if name == "reference":
        from jaxinfer.ops import reference

        return reference
    if name in ("pallas", "pallas-interpret"):
        from jaxinfer.ops import pallas

        return pallas.make(interpret=name == "pallas-interpret")
    raise ValueError(f"unknown ops backend {name!r} ({', '.join(BACKENDS)})")


BACKENDS = ("reference", "pallas", "pallas-interpret")
