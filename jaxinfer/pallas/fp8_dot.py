"""e4m3 x e4m3 tile products on Hopper's fp8 tensor cores (wgmma), not upcast to float16.

Pallas Triton (jax 0.11.2) lowers a dot_general to `tt.dot` without the `maxNumImpreciseAcc` attribute, which Triton's
own `tl.dot` sets for fp8 operands (2^30). Without it Triton 3.6 upcasts both e4m3 operands to float16 and runs
mma.sync (HMMA, F2FP conversions in the loop) instead of wgmma's e4m3 product: read offline for the W8A8 skinny GEMM,
`bench/kernel_registers.py --weights fp8-w8a8 --sass` (the int8 W8A8 product lowers to wgmma, IGMMA, as it is).

`install(prefix)` wraps the dot_general lowering rule (once) and registers a kernel-name prefix: in the kernels whose
name starts with a registered prefix, e4m3 x e4m3 dots get maxNumImpreciseAcc = the dot's own K. wgmma then sums
those K products in its own accumulator (Hopper's fp8 accumulation keeps fewer bits than float32's); the registered
kernels (skinny_gemm's W8A8) add each tile's product to a float32 accumulator outside the dot, so at most a tile's K
(64-256) products are summed that way, as DeepSeek-V3's FP8 GEMMs promote every 128. Every other dot, and every
kernel not registered (other code's Pallas kernels in the same process), lowers as before.
"""

from __future__ import annotations

import functools

from jax import lax
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

_PREFIXES: set[str] = set()


def _e4m3(v) -> bool:
    return isinstance(ir.RankedTensorType(v.type).element_type, ir.Float8E4M3FNType)


def _with_imprecise_acc(rule):
    @functools.wraps(rule)
    def lower(ctx, a, b, **params):
        out = rule(ctx, a, b, **params)
        if _e4m3(a) and _e4m3(b) and ctx.context.name.startswith(tuple(_PREFIXES)):
            op = out.owner
            if op.name == "tt.dot":   # the product itself (a float32 result needs no cast after it)
                ((k_dim,), _), _ = params["dimension_numbers"]
                k = ir.RankedTensorType(a.type).shape[k_dim]
                op.attributes["maxNumImpreciseAcc"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), k)
        return out
    lower.wraps_fp8_dots = True
    return lower


def install(prefix: str) -> None:
    """Lower the e4m3 dots of the kernels whose names start with `prefix` to wgmma's e4m3 product (the lowering
    rule is wrapped once)."""
    rules = lowering.triton_lowering_rules
    if not getattr(rules[lax.dot_general_p], "wraps_fp8_dots", False):
        rules[lax.dot_general_p] = _with_imprecise_acc(rules[lax.dot_general_p])
    _PREFIXES.add(prefix)
