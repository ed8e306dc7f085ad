"""acc + a @ b as one Triton dot that accumulates into acc (tt.dot(a, b, acc)), for the kernels' K loops.

Pallas lowers `acc + jax.lax.dot_general(a, b)` to a `tt.dot` into zeros made by `tt.splat` and an `arith.addf`.
Triton's combine pass folds `addf(acc, dot(a, b, 0))` into `dot(a, b, acc)` only when it recognises the zeros, and
it does not recognise a splat (Triton 3.6, compiled offline by bench/kernel_registers.py --sass). So each K step of a
Pallas Triton GEMM waits for its wgmma to finish (`warp_group_dot_wait` with no pending group), then adds the fresh
product tile into the accumulator with one FADD an element, in twice the accumulator registers: the grouped GEMM's
loop at Mixtral's shapes is 155 SASS instructions a warp against 91 with the accumulator given to the dot, 158
registers against 92, and with it the wgmma of step k overlaps step k + 1. `accumulating_dot` emits the dot into the
accumulator directly.

On the GPU the sum's order changes: the products are added into acc inside the MMA, not summed apart first (float32
rounding, a few ulp of the accumulator). In interpret mode (the CPU tests) it is `acc + dot_general(...)`, the same
operations as before. Float32 operands (the float32 reference-precision paths) keep `acc + dot_general` everywhere:
their product is Pallas's three-pass split, which this lowering does not do. `tables.DOT_INTO_ACCUMULATOR` turns it
on (off until a GPU run measures it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

from jaxinfer.pallas import tables

accumulating_dot_p = jax_core.Primitive("jaxinfer_accumulating_dot")


def _reference(a, b, acc, *, dims):
    return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


@accumulating_dot_p.def_abstract_eval
def _abstract_eval(a, b, acc, *, dims):
    del a, b, dims
    return jax_core.ShapedArray(acc.shape, acc.dtype)


accumulating_dot_p.def_impl(_reference)
mlir.register_lowering(accumulating_dot_p, mlir.lower_fun(_reference, multiple_results=False))


@triton_lowering.register_lowering(accumulating_dot_p)
def _triton_lowering(ctx, a, b, acc, *, dims):
    del ctx
    ((a_contract,), (b_contract,)), _ = dims
    if a_contract == 0:
        a = tt_dialect.trans(a, (1, 0))
    if b_contract == 1:
        b = tt_dialect.trans(b, (1, 0))
    return tt_dialect.dot(a, b, acc)


def accumulating_dot(a: jax.Array, b: jax.Array, acc: jax.Array, dims=(((1,), (0,)), ((), ())), *,
                     precision=None) -> jax.Array:
    """acc + a . b contracted as `dims` (dot_general's, no batch axes), acc float32 [M, N]: one Triton dot into acc
    where tables.DOT_INTO_ACCUMULATOR says so and a, b are of one 16-bit dtype, else the sum of a dot_general at
    `precision` (blocks.dot_precision's) into zeros and acc (see the module docstring)."""
    if (not tables.DOT_INTO_ACCUMULATOR or a.dtype != b.dtype
            or jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))):
        return acc + jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
    return accumulating_dot_p.bind(a, b, acc, dims=dims)
