"""The op interface. `get_ops(name)` returns a namespace of ops with the signatures of ops.reference:
"reference" (jax.numpy), "pallas" (Pallas GPU kernels where they measured faster), "pallas-interpret"
(the same kernels in interpret mode, for CPU tests)."""

import functools


@functools.cache
def get_ops(name: str = "reference"):
    if name == "reference":
        from jaxinfer.ops import reference

        return reference
    if name in ("pallas", "pallas-interpret"):
        from jaxinfer.ops import pallas

        return pallas.make(interpret=name == "pallas-interpret")
    raise ValueError(f"unknown ops backend {name!r} (reference, pallas, pallas-interpret)")
