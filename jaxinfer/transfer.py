"""Host arrays go to the device in one copy.

A step's batch is ~20 small numpy arrays; `jax.device_put` of the pytree makes one transfer per
array, each with its own fixed cost. Measured: the host time before a 1k-token prefill step on the
H200 went from 2.6 to 1.55 ms with this; on the 2-core CPU the batch's transfer went from 0.31 to
0.18 ms. `to_device` packs every leaf into one int32 buffer (floats and unsigned ints bit for bit,
bools as 0/1), copies that, and splits it on the device in one small compiled function per layout
(compiled at warm-up with the steps, since the engine's batches come in a fixed set of shapes).
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
        spec.append((a.shape, a.dtype.name))
    buf = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return buf, Layout(treedef, tuple(spec))


@functools.partial(jax.jit, static_argnums=1)
def unpack(buf: jax.Array, layout: Layout):
    """The inverse of `pack`, on the device."""
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


def to_device(tree):
    """`jax.device_put(tree)` for a pytree of numpy arrays, as one host-to-device copy."""
    buf, layout = pack(tree)
    return unpack(jax.device_put(buf), layout)
