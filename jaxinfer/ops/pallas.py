"""The op interface with Pallas GPU kernels swapped in, op by op, where they measured faster.

Every op not overridden here is the reference op. `interpret=True` (set by `get_ops("pallas-interpret")`)
runs the kernels in Pallas interpret mode so that this backend is testable on the CPU.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from jaxinfer.ops import reference


class OpSet(SimpleNamespace):
    """A namespace of ops, hashable by identity so that it can be a static argument of jax.jit."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def make(interpret: bool = False) -> OpSet:
    from jaxinfer.pallas import gemv

    ops = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    ops["linear"] = functools.partial(gemv.linear, interpret=interpret)
    return OpSet(**ops, name="pallas-interpret" if interpret else "pallas")
