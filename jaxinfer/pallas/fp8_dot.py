"""e4m3 x e4m3 tile products on Hopper's fp8 tensor cores (wgmma), not upcast to float16.

Pallas Triton (jax 0.11.2) lowers a dot_general to `tt.dot` without the `maxNumImpreciseAcc` attribute, which Triton's
own `tl.dot` sets for fp8 operands (2^30). Without it Triton 3.6 upcasts both e4m3 operands to float16 and runs
mma.sync (HMMA, F2FP conversions in the loop) instead of wgmma's e4m3 product: read offline for the W8A8 skinny GEMM,
`bench/kernel_registers.py --weights fp8-w8a8 --sass` (the int8 W8A8 product lowers to wgmma, IGMMA, as it is).

`install()` wraps the dot_general lowering rule once: for e4m3 x e4m3 dots it sets maxNumImpreciseAcc to the dot's
own K. wgmma then sums those K products in its own accumulator (Hopper's fp8 accumulation keeps fewer than float32's
bits); the kernels that use it (skinny_gemm's W8A8) add each tile's product to a float32 accumulator outside the dot,
so at most a tile's K (64-256) products are summed that way, as DeepSeek-V3's FP8 GEMMs promote every 128. Every
other dot lowers as before.
"""

from __future__ import annotations

import functools

from jax import lax
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

_INSTALLED = False


def _with_imprecise_acc(rule):
    @functools.wraps(rule)
    def lower(ctx, a, b, **params):
        out = rule(ctx, a, b, **params)
        if all(isinstance(ir.RankedTensorType(v.type).element_type, ir.Float8E4M3FNType) for v in (a, b)):
            op = out.owner
            if op.name == "tt.dot":   # the product itself (a float32 result needs no cast after it)
                ((k_dim,), _), _ = params["dimension_numbers"]
                k = ir.RankedTensorType(a.type).shape[k_dim]
                op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), k)
        return out
    return lower


def install() -> None:
    """Wrap Pallas Triton's dot_general lowering (idempotent)."""
    global _INSTALLED
    if not _INSTALLED:
        rules = lowering.triton_lowering_rules
        rules[lax.dot_general_p] = _with_imprecise_acc(rules[lax.dot_general_p])
        _INSTALLED = True
