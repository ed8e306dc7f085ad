"""An op set over a device mesh (tensor parallelism): the base ops, plus the mesh, plus the op set each device
runs inside shard_map, in which the output projections (o_proj, down: input rows split over the devices) sum
their partial products across the mesh with one all-reduce (XLA's collective: NCCL on GPUs): `linear_residual`
before the residual add, `linear_out` (Gemma 3's normed block outputs) before the norm, and a mixture of experts
(every expert's intermediate rows split; routing replicated) after its combine, before the residual add.

The model (model.tensor_parallel) puts the layers under shard_map when an op set carries a mesh; every kernel of
the base set then runs per shard, on per-device shapes.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxinfer.ops import weight
from jaxinfer.ops.pallas import OpSet

AXIS = "tp"   # the mesh's one axis (model.tensor_parallel.AXIS)


def _members(base: ModuleType | OpSet) -> dict:
    if isinstance(base, ModuleType):
        return {k: getattr(base, k) for k in dir(base) if not k.startswith("_")}
    return dict(vars(base))


def shard_ops(base: ModuleType | OpSet) -> OpSet:
    """The ops one device runs inside shard_map: the base set, with the row-split projections all-reduced."""

    def reduced(x, w, b=None):
        y = jax.lax.psum(base.linear(x, w), AXIS)   # the partial products in x's dtype: one all-reduce
        if b is not None:   # added once, after the sum
            y = (y.astype(jnp.float32) + weight(b).astype(jnp.float32)).astype(x.dtype)
        return y

    def linear_residual(x, w, b, residual):
        return residual + reduced(x, w, b)

    def linear_residual_norm_swiglu(x, w, b, residual, scale, eps, w_gate_up):
        r = linear_residual(x, w, b, residual)
        return r, base.rms_norm_swiglu(r, scale, eps, w_gate_up)

    def moe_mlp(x, router, w_gate_up, w_down, top_k, renormalize, residual=None):
        # every expert's intermediate rows split: each device's combine is a partial sum of the whole output
        y = jax.lax.psum(base.moe_mlp(x, router, w_gate_up, w_down, top_k, renormalize), AXIS)
        return y if residual is None else residual + y

    def rms_norm_moe_mlp(x, scale, eps, router, w_gate_up, w_down, top_k, renormalize, residual=True):
        y = jax.lax.psum(base.rms_norm_moe_mlp(x, scale, eps, router, w_gate_up, w_down, top_k, renormalize,
                                               residual=False), AXIS)
        return x + y if residual else y   # the residual added once, after the sum (not by the kernel's epilogue)

    members = _members(base)
    return OpSet(**{**members, "linear_residual": linear_residual, "linear_out": reduced,
                    "linear_residual_norm_swiglu": linear_residual_norm_swiglu, "moe_mlp": moe_mlp,
                    "rms_norm_moe_mlp": rms_norm_moe_mlp,
                    "name": f"{members.get('name', getattr(base, '__name__', 'ops'))}/shard"})


@functools.cache
def tensor_parallel_ops(base: ModuleType | OpSet, mesh: Mesh) -> OpSet:
    """`base` over `mesh` (a one-axis mesh named "tp"): the same ops outside the layers, `mesh`, and `shard_ops`
    for inside them. Cached: one op set (a static jit argument, hashed by identity) per base and mesh."""
    if mesh.axis_names != (AXIS,):
        raise ValueError(f"a tensor-parallel mesh has the one axis {AXIS!r}, got {mesh.axis_names}")
    members = _members(base)
    name = members.get("name", getattr(base, "__name__", "ops").rsplit(".", 1)[-1])
    return OpSet(**{**members, "name": f"{name}+tp{mesh.size}", "mesh": mesh, "shard_ops": shard_ops(base)})
