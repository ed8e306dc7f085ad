"""The op interface with Pallas GPU kernels swapped in, op by op, where they measured faster.

Ops not overridden here are the reference ops. Composite ops (norm + projection, projection +
residual) are rebuilt on top of the Pallas `linear` until a fused kernel replaces them.
`get_ops("pallas-interpret")` runs the same kernels in Pallas interpret mode, for CPU tests.
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

    linear = functools.partial(gemv.linear, interpret=interpret)

    def rms_norm_linear(x, scale, eps, w, b=None):
        return linear(reference.rms_norm(x, scale, eps), w, b)

    def rms_norm_swiglu(x, scale, eps, w_gate_up):
        return reference.swiglu(rms_norm_linear(x, scale, eps, w_gate_up))

    def linear_residual(x, w, b, residual):
        return residual + linear(x, w, b)

    ops = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    ops.update(linear=linear, rms_norm_linear=rms_norm_linear, rms_norm_swiglu=rms_norm_swiglu,
               linear_residual=linear_residual)
    return OpSet(**ops, name="pallas-interpret" if interpret else "pallas")
