"""Elementwise inline PTX that Triton leaves where the kernel computes it.

`plgpu.elementwise_inline_asm` lowers to a pure `tt.elementwise_inline_asm`, which Triton's layout passes may move
across a layout conversion. For an int8 tile feeding a dot they do: the conversion to float16 is hoisted past the
conversion to the MMA operand's layout (moving bytes is cheaper than moving halves), so the int8 values are loaded
from shared memory straight into the operand's registers. Where the operand's reduction axis is the tile's strided
one (the V tile of p @ v: four consecutive positions a register) that is one `LDS.U8` a byte and permutes to pack
them: the H200's int8 decode attention loop spent ~450 of its ~1,470 instructions a block there
(bench/kernel_registers.py --sass). `pinned_inline_asm` lowers the same PTX as not pure, so it stays in the layout
the tile was loaded in (vectorized) and Triton stages the float16 tile through shared memory to the MMA
(`ldmatrix`), as it does for bf16 pages.

Triton lowering only (no interpret rule: interpret mode runs the kernels' "cvt" conversions instead).
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

pinned_inline_asm_p = jax_core.Primitive("jaxinfer_pinned_inline_asm")
pinned_inline_asm_p.multiple_results = True


@pinned_inline_asm_p.def_abstract_eval
def _abstract_eval(*avals, asm, constraints, pack, result_shape_dtypes):
    del avals, asm, constraints, pack
    return [jax_core.ShapedArray(s.shape, s.dtype) for s in result_shape_dtypes]


@triton_lowering.register_lowering(pinned_inline_asm_p)
def _lowering(ctx, *args, asm, constraints, pack, result_shape_dtypes):
    del result_shape_dtypes
    return [tt_dialect.elementwise_inline_asm([mlir.aval_to_ir_type(ctx.context.mlir_ctx, a) for a in ctx.avals_out],
                                              asm, constraints=constraints, pure=False, packed_element=pack,
                                              args=args)]


def pinned_inline_asm(asm: str, *, args: Sequence[jax.Array], constraints: str, pack: int,
                      result_shape_dtypes: Sequence[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    """plgpu.elementwise_inline_asm's arguments and results, lowered as not pure (see the module docstring)."""
    return pinned_inline_asm_p.bind(*args, asm=asm, constraints=constraints, pack=pack,
                                    result_shape_dtypes=tuple(result_shape_dtypes))
