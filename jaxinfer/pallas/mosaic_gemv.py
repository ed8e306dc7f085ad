"""Decode-row products on Hopper through Mosaic GPU, for programmatic dependent launch (an experiment, not in the ops).

    y [T, N] = x [T, K] @ w[layer].T          epilogue "none"
    y [T, N] = round(x @ w.T) + residual      epilogue "residual" (as reference.linear_residual)
    y [T, I] = silu_mul(gate, up)             epilogue "swiglu" (w: the fused [2I, K] gate/up matrix)

Why Mosaic GPU for a GEMV: the decode step's kernels each lose their ramp and tail (bench/NOTES.md, issue 3), and
only a kernel launched programmatically can start while the one before it drains. jaxlib 0.11.2's XLA launches a
Mosaic GPU kernel so when its module uses griddepcontrol (`mosaic_gpu.uses_pdl`), never a Pallas Triton one
(twenty-sixth session). With `pdl`, a CTA lets the next kernel launch at its start, puts its first weight tiles in
flight (the pipeline's prologue), and only then waits for the kernel before and loads x (and, at the end, the
residual): weights never depend on it.

Layout: W is wgmma's A operand (64 of its rows a CTA, [64, 64] tiles by TMA through a `stages`-deep ring), x is B
([TB, K] resident in shared memory, TB = 8 or 16 rows: the caller's T padded), the [64, TB] float32 accumulator is
stored transposed (only the T real rows reach y). So N (the gate rows, for SwiGLU) must be a multiple of 64 and K of
64; T <= 16. Every product is exact in float32 (bf16 operands); y rounds as the reference does (`reference`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxinfer.pallas import hopper_gemm
from jaxinfer.pallas.blocks import run_mosaic, silu_mul

TK = 64          # K columns a tile: 64 bf16 = one 128-byte swizzled row
ROWS = 64        # W rows a CTA (wgmma's M)
MAX_T = 16
EPILOGUES = ("none", "residual", "swiglu")


def supported(T: int, N: int, K: int, epilogue: str = "none") -> bool:
    """Whether the product tiles (rows by ROWS, K by TK) and x fits in shared memory (above 8 rows, K <= 4,096)."""
    cols = N // 2 if epilogue == "swiglu" else N
    fits = T <= 8 or K <= 4096
    return 0 < T <= MAX_T and cols % ROWS == 0 and K % TK == 0 and epilogue in EPILOGUES and fits


def _swizzled():
    """[8, 64]-element tiles, 128-byte swizzle: the layout wgmma reads W and x in."""
    return plgpu.TilingTransform((8, TK)), plgpu.SwizzleTransform(128)


def _kernel(*refs, T, layer, cols, steps, stages, epilogue, pdl):
    if epilogue == "residual":
        x_gmem, w_gmem, res_gmem, o_gmem, x_smem, out_smem, res_smem, x_bar = refs
    else:
        (x_gmem, w_gmem, o_gmem, x_smem, out_smem, x_bar), res_gmem, res_smem = refs, None, None
    c = lax.axis_index("cta")
    n_w = 2 if epilogue == "swiglu" else 1
    row_ranges = [pl.ds(c * ROWS + j * cols, ROWS) for j in range(n_w)]   # gate rows, then up rows
    if pdl:
        plgpu.griddepcontrol_launch_dependents()

    def with_accs(accs):
        def step(idx, *w_smems):
            k = idx[0]

            @pl.when(k == 0)   # the ring's first `stages` weight tiles are in flight by now
            def _():
                if pdl:
                    plgpu.griddepcontrol_wait()
                plgpu.copy_gmem_to_smem(x_gmem, x_smem, x_bar)
                plgpu.barrier_wait(x_bar)

            x_t = x_smem.at[:, pl.ds(k * TK, TK)]
            for acc, w_smem in zip(accs, w_smems):
                plgpu.wgmma(acc, w_smem, x_t.T)
            plgpu.wgmma_wait(0)

        spec = plgpu.BlockSpec((ROWS, TK), lambda k: (0, k), transforms=_swizzled())
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=[spec] * n_w, max_concurrent_steps=stages)(
            *[w_gmem.at[layer, r] for r in row_ranges])
        ys = [acc[...].astype(o_gmem.dtype) for acc in accs]   # [ROWS, TB]: the products round here
        out_smem.T[...] = silu_mul(*ys) if epilogue == "swiglu" else ys[0]
        out_cols = pl.ds(c * ROWS, ROWS)
        if epilogue == "residual":   # its T rows (the padding rows' sums are never stored)
            plgpu.copy_gmem_to_smem(res_gmem.at[:, out_cols], res_smem.at[pl.ds(0, T)], x_bar)
            plgpu.barrier_wait(x_bar)
            out_smem[...] = out_smem[...] + res_smem[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, T)], o_gmem.at[:, out_cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(with_accs, [plgpu.ACC((ROWS, x_smem.shape[0]), jnp.float32) for _ in range(n_w)])


@functools.partial(jax.jit, static_argnames=("layer", "epilogue", "pdl", "stages", "interpret"))
def mosaic_gemv(x: jax.Array, w: jax.Array, layer: int = 0, *, residual: jax.Array | None = None,
                epilogue: str = "none", pdl: bool = False, stages: int = 4, interpret: bool = False) -> jax.Array:
    """x [T, K] (T <= 16); w [L, N, K] read at the static `layer` (or [N, K]); see the module's docstring. In
    interpret mode (the CPU tests) the griddepcontrol calls are left out: Mosaic GPU's interpreter has none."""
    pdl = pdl and not interpret
    if w.ndim == 2:
        w = w[None]
    T, K = x.shape
    _, N, K2 = w.shape
    if K2 != K or x.dtype != w.dtype:
        raise ValueError(f"mosaic_gemv: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} do not match")
    if not supported(T, N, K, epilogue):
        raise ValueError(f"mosaic_gemv: T={T}, ({N}, {K}) {epilogue!r} is not supported (T <= {MAX_T}, "
                         f"rows by {ROWS}, K by {TK}; above 8 rows K <= 4,096: x stays in shared memory)")
    cols = N // 2 if epilogue == "swiglu" else N
    if (epilogue == "residual") != (residual is not None) or (residual is not None and residual.shape != (T, N)):
        raise ValueError(f"mosaic_gemv: a residual [{T}, {N}] goes with epilogue='residual'")
    TB = 8 if T <= 8 else 16
    xp = jnp.pad(x, ((0, TB - T), (0, 0))) if TB > T else x   # B's rows: the batch padded (the pad is not stored)
    call = plgpu.kernel(
        functools.partial(_kernel, T=T, layer=layer, cols=cols, steps=K // TK, stages=stages, epilogue=epilogue,
                          pdl=pdl),
        out_type=jax.ShapeDtypeStruct((T, cols), x.dtype),
        grid=(cols // ROWS,), grid_names=("cta",),
        scratch_types=[plgpu.SMEM((TB, K), x.dtype, transforms=_swizzled()), plgpu.SMEM((TB, ROWS), x.dtype)]
        + ([plgpu.SMEM((TB, ROWS), x.dtype)] if residual is not None else []) + [plgpu.Barrier(num_arrivals=1)],
        kernel_name=f"mosaic_gemv_{epilogue}" + ("_pdl" if pdl else ""),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return run_mosaic(call, xp, w, *(() if residual is None else (residual,)), interpret=interpret)


def reference(x: jax.Array, w: jax.Array, layer: int = 0, epilogue: str = "none",
              residual: jax.Array | None = None) -> jax.Array:
    """The kernel's twin: hopper_gemm's (the reference ops' product, then + residual, or SwiGLU as silu_mul) at
    the layer's matrix."""
    return hopper_gemm.reference(x, w[layer] if w.ndim == 3 else w, residual, epilogue)
