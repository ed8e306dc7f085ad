"""Host arrays go to the device in one copy.

A step's batch is ~20 small numpy arrays; `jax.device_put` of the pytree makes one transfer per
array, each with its own fixed cost (about a millisecond of host time before a 1k-token prompt step,
docs/engine.md). `to_device` packs every leaf into one int32 buffer (floats and unsigned ints bit for bit,
bools as 0/1), copies that, and splits it on the device in one small compiled function per layout
(compiled at warm-up with the steps, since the engine's batches come in a fixed set of shapes).

`to_device_packed` leaves the split to the step that takes the batch: it returns a `Packed` (the
buffer, with its layout as static pytree data), which a jitted function unpacks inside (`unpacked`),
where the slices fuse into their consumers. That saves the split's own dispatch and hands the step one
array instead of ~20 (a call's host time grows with its arguments). The engine's prompt steps take their
batch so.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_BITCAST = (np.dtype(np.float32), np.dtype(np.uint32))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed pytree lies in the flat buffer (hashable: a static jit argument)."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]   # (shape, dtype name) per leaf


def pack(tree) -> tuple[np.ndarray, Layout]:
    """Flatten a pytree of numpy arrays (int32, bool, float32, uint32) into one int32 array."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts, spec = [], []
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.int32:
            flat = a.ravel()
        elif a.dtype == np.bool_:
            flat = a.ravel().astype(np.int32)
        elif a.dtype in _BITCAST:
            flat = np.ascontiguousarray(a).ravel().view(np.int32)
        else:
            raise TypeError(f"to_device packs int32, bool, float32 and uint32 arrays, not {a.dtype}")
        parts.append(flat)
        spec.append((a.shape, _dtype_name(a.dtype)))
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, Layout(treedef, tuple(spec))


@functools.lru_cache(maxsize=16)
def _dtype_name(dtype: np.dtype) -> str:
    """numpy computes `dtype.name` in Python (~10 us); pack asks for it once per leaf."""
    return dtype.name


def _split(buf: jax.Array, layout: Layout):
    out, offset = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        part = buf[offset:offset + n].reshape(shape)
        offset += n
        if dtype == "bool":
            part = part != 0
        elif dtype != "int32":
            part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        out.append(part)
    return jax.tree_util.tree_unflatten(layout.treedef, out)


@functools.partial(jax.jit, static_argnums=1)
def unpack(buf: jax.Array, layout: Layout):
    """The inverse of `pack`, on the device."""
    return _split(buf, layout)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed pytree: its one buffer (the pytree leaf) and its layout (static: part of a jitted
    function's signature, so each layout compiles once)."""

    buf: Any
    layout: Layout

    def tree_flatten(self):
        return (self.buf,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def shapes(self):
        """The packed pytree with each leaf's shape in its place (e.g. `.shapes().tokens` of a StepBatch)."""
        return jax.tree.map(lambda i: self.layout.leaves[i][0], _leaf_indices(self.layout.treedef))

    def field_shape(self, name: str) -> tuple[int, ...]:
        """One named field's shape (a dataclass pytree's, e.g. a StepBatch's "tokens"), without building the
        pytree: ~0.7 us where shapes() takes ~10 (it runs before every prompt step)."""
        return self.layout.leaves[getattr(_leaf_indices(self.layout.treedef), name)][0]


@functools.lru_cache(maxsize=64)
def _leaf_indices(treedef):
    """The pytree of this structure with each leaf's index in the flattened order (once per structure)."""
    return jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))


def unpacked(tree):
    """Inside a jitted function: a Packed argument split back into its pytree (anything else as is)."""
    return _split(tree.buf, tree.layout) if isinstance(tree, Packed) else tree


def to_device_packed(tree) -> Packed:
    """The pytree of numpy arrays on the device as one buffer, to be split by the step (`unpacked`)."""
    buf, layout = pack(tree)
    return Packed(jax.device_put(buf), layout)


def to_device(tree):
    """`jax.device_put(tree)` for a pytree of numpy arrays, as one host-to-device copy."""
    packed = to_device_packed(tree)
    return unpack(packed.buf, packed.layout)
