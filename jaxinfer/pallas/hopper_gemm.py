"""Prompt-row GEMM on Hopper tensor cores through Mosaic GPU (wgmma + TMA), with fused epilogues.

y = x [M, K] @ w[N, K].T, bf16 inputs, float32 accumulation, then an epilogue, rounding as the
reference ops round (as skinny_gemm's epilogues do):
  "none":     round to x.dtype;
  "residual": round, then add residual [M, N] (reference.linear_residual);
  "swiglu":   w is the fused [2I, K] gate/up matrix; gate and up are each rounded, then
              silu_mul (reference.rms_norm_swiglu after its norm): [M, I].
The Triton GEMM from Pallas reached 61-76% of cuBLAS's rate at 1k prompt rows, too
slow to pay for its epilogues; this one is built the way Hopper GEMMs reach the tensor-core rate:
a persistent grid of one CTA an SM walking output tiles in a planar snake (L2 reuse of weight
tiles), a memory warpgroup streaming x and w tiles through a multi-stage shared-memory ring by TMA,
and two compute warpgroups (each tile_m of the CTA's 2 x tile_m rows) issuing wgmma on them. Both
compute warpgroups read the same weight tile: weights cross the bus once per CTA tile. The
weight tile is loaded as stored ([tile_n, tile_k], K-major) and handed to wgmma transposed.

Grouped (a mixture of experts' prompt rows, `row_tile_group`): w is a stack [G, N, K] and each CTA tile of rows
multiplies the matrix its group names (row_tile_group[i] for rows i * cta_m ..), or is skipped where that is
negative (its output rows are left unwritten). The rows come sorted by group with each group padded to whole tiles
(pallas/expert_tiles.py), so that no tile holds two groups' rows and every store stays a whole-tile TMA copy.

Shapes must tile exactly (M and N by the CTA tile, `cta_tile`; K by tile_k); `supported` says whether they
do. `interpret=True` runs Mosaic GPU's interpret mode (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import EIGHT_BIT, run_mosaic, silu_mul
from jaxinfer.pallas.tables import HopperConfig

EPILOGUES = ("none", "residual", "swiglu")
f32 = jnp.float32


def table_config(M: int, N: int, K: int, epilogue: str, eight_bit: str | None = None) -> HopperConfig | None:
    """The measured config for M prompt rows of this product, or None where XLA's GEMM is the faster; eight_bit
    ("int8" or "fp8"): W8A8 on 8-bit weights of that format with a scale per output channel
    (tables.HOPPER_GEMM_8BIT)."""
    table, key = ((tables.HOPPER_GEMM_8BIT, (N, K, epilogue, eight_bit)) if eight_bit
                  else (tables.HOPPER_GEMM, (N, K, epilogue)))
    return _measured(table.get(key, ()), M, lambda config: supported(M, N, K, epilogue, config))


def grouped_table_config(assignments: int, E: int, N: int, K: int, epilogue: str) -> HopperConfig | None:
    """The measured config for a mixture of experts' product of `assignments` rows (tokens x top_k) over E experts'
    [N, K] matrices (tables.HOPPER_GROUPED_GEMM), or None. Its columns and depth must tile; the rows always do (the
    padded layout is whole tiles)."""
    return _measured(tables.HOPPER_GROUPED_GEMM.get((E, N, K, epilogue), ()), assignments,
                     lambda config: supported(cta_tile(config)[0], N, K, epilogue, config))


def _measured(rows, count: int, fits) -> HopperConfig | None:
    """The config of the first table row (first, last, config) whose range holds `count` and that `fits`."""
    return next((config for first, last, config in rows if first <= count <= last and fits(config)), None)


def cta_tile(config: HopperConfig) -> tuple[int, int]:
    """(rows, columns) of a CTA's output tile: two warpgroups side by side along M."""
    return 2 * config.tile_m, config.tile_n


def supported(M: int, N: int, K: int, epilogue: str, config: HopperConfig) -> bool:
    cols = N // 2 if epilogue == "swiglu" else N
    cta_m, cta_n = cta_tile(config)
    return (M % cta_m == 0 and cols % cta_n == 0 and K % config.tile_k == 0
            and config.tile_n % config.epi_n == 0 and (epilogue != "swiglu" or N % 2 == 0))


def _kernel(x_gmem, w_gmem, *refs, config: HopperConfig, epilogue: str, cols: int, scaled: bool, grouped: bool):
    refs = list(refs)
    out_gmem = refs.pop()
    group_gmem = refs.pop(0) if grouped else None
    xs_gmem, ws_gmem = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
    res_gmem = refs.pop(0) if epilogue == "residual" else None
    M, K = x_gmem.shape
    dtype = out_gmem.dtype
    tm, tn, tk, en = config.tile_m, config.tile_n, config.tile_k, config.epi_n
    cta_m, cta_n = cta_tile(config)
    m_iters, n_iters, k_iters = M // cta_m, cols // cta_n, K // tk
    swizzle = plgpu.find_swizzle(tk * jnp.dtype(x_gmem.dtype).itemsize * 8)
    in_transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(x_gmem.dtype).itemsize)),
                     plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(en * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    n_w = 2 if epilogue == "swiglu" else 1     # weight tiles a step: gate and up, or the one matrix
    acc_dtype = jnp.int32 if x_gmem.dtype == jnp.int8 else f32
    # e4m3 wgmma adds into its accumulator with fewer bits than float32 keeps (DeepSeek-V3's report: ~14 on H800),
    # so an fp8 product of thousands of columns would drift: each k step's products go to a fresh accumulator and are
    # added to float32 sums in registers (tile_k values a wgmma chain). int8 sums are exact in int32.
    promote = x_gmem.dtype == jnp.float8_e4m3fn

    def pipeline(body, compute_context):
        w_spec = plgpu.BlockSpec((cta_n, tk), lambda k: (0, k), transforms=in_transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), transforms=in_transforms,
                                      memory_space=plgpu.SMEM)] + [w_spec] * n_w,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.stages,
            compute_context=compute_context)

    w_one = w_gmem.at[0] if grouped else w_gmem    # a matrix of the stack: the pipeline's shapes
    w_args = (w_one, w_one) if n_w == 2 else (w_one,)
    ignore = lambda *_, **__: None  # noqa: E731  (allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, *w_args),
        out_smem=plgpu.SMEM((2, 2, tm, en), dtype, transforms=out_transforms),
        res_barrier=None if res_gmem is None else plgpu.Barrier(num_barriers=4),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem, res_barrier):
        wg = lax.axis_index("wg")

        def _output_tile(m_idx, n_idx, w_mat):
            """The CTA's output tile (m_idx, n_idx) of x @ w_mat.T, its epilogue applied and stored."""
            k_range = pl.ds(0, k_iters * tk)
            cta_rows = pl.ds(m_idx * cta_m, cta_m)
            wg_rows = pl.ds(m_idx * cta_m + wg * tm, tm)
            wg_col0 = n_idx * cta_n     # the warpgroup's first output column

            def epilogue_out(sums):
                """The accumulators' values (float32, or int32 in int8 W8A8) rounded, the epilogue applied, stored."""
                if scaled:
                    ys = [_scaled(acc, xs_gmem.at[wg_rows], ws_gmem.at[pl.ds(c0, tn)]).astype(dtype)
                          for acc, c0 in zip(sums, w_col0s)]
                else:
                    ys = [acc.astype(dtype) for acc in sums]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for e in range(tn // en):
                    cols_e = slice(e * en, (e + 1) * en)
                    out_cols = pl.ds(wg_col0 + e * en, en)
                    slot = out_smem.at[wg, e % 2]
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    if epilogue == "swiglu":
                        slot[...] = silu_mul(ys[0][:, cols_e], ys[1][:, cols_e])
                    elif epilogue == "residual":
                        barrier = res_barrier.at[wg * 2 + e % 2]
                        plgpu.copy_gmem_to_smem(res_gmem.at[wg_rows, out_cols], slot, barrier)
                        plgpu.barrier_wait(barrier)
                        slot[...] = slot[...] + ys[0][:, cols_e]
                    else:
                        slot[...] = ys[0][:, cols_e]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(slot, out_gmem.at[wg_rows, out_cols])

            def compute_context(run):
                if promote:     # the carry: float32 sums in registers, one k step's products added at a time
                    epilogue_out(run([plgpu.layout_cast(jnp.zeros((tm, tn), f32), plgpu.Layout.WGMMA)
                                      for _ in range(n_w)]))
                    return

                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((tm, tn), acc_dtype) for _ in range(n_w)])
                def _accs(accs):
                    run(accs)
                    epilogue_out([acc[...] for acc in accs])

            def mma(_, x_smem, *w_and_carry):
                w_smems, carry = w_and_carry[:n_w], w_and_carry[n_w]
                x_wg = x_smem.at[pl.ds(wg * tm, tm)]
                if promote:
                    def products(refs):
                        for ref, w_smem in zip(refs, w_smems):
                            plgpu.wgmma(ref, x_wg, w_smem.T)
                        return [ref[...] for ref in refs]      # reading an accumulator waits for its wgmma

                    step = pl.run_scoped(products, [plgpu.ACC((tm, tn), f32) for _ in range(n_w)])
                    return [total + p for total, p in zip(carry, step)]
                for acc, w_smem in zip(carry, w_smems):
                    plgpu.wgmma(acc, x_wg, w_smem.T)
                plgpu.wgmma_wait(0)
                return carry

            w_col0s = [n_idx * cta_n] + ([cols + n_idx * cta_n] if n_w == 2 else [])   # gate's, then up's
            col_slices = [pl.ds(c0, cta_n) for c0 in w_col0s]
            pipeline(mma, compute_context)(x_gmem.at[cta_rows, k_range], *[w_mat.at[c, k_range] for c in col_slices],
                                           allocations=allocs)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), 0, config.snake_width)
            if not grouped:
                _output_tile(m_idx, n_idx, w_gmem)
                return
            group = group_gmem[m_idx]
            pl.when(group >= 0)(lambda: _output_tile(m_idx, n_idx, w_gmem.at[jnp.maximum(group, 0)]))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _scaled(acc: jax.Array, xs_rows, ws_cols) -> jax.Array:
    """A W8A8 accumulator [tm, tn] (float32 or int32) times its rows' and columns' scales, in float32 and in that
    order (XLA's W8A8 product's). The scales are read from global memory straight into the accumulator's row and
    column layouts: tm + tn floats a tile."""
    tm, tn = acc.shape
    xs = plgpu.load(xs_rows, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ws = plgpu.load(ws_cols, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
    return (acc.astype(f32) * lax.broadcast_in_dim(xs, (tm, tn), [0])) * lax.broadcast_in_dim(ws, (tm, tn), [1])


@functools.cache
def available() -> bool:
    """wgmma and TMA need a Hopper GPU (compute capability 9.x); the table's shapes exist on any GPU."""
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def num_sms() -> int:
    try:
        return jax.devices("gpu")[0].core_count
    except RuntimeError:
        return 4


@functools.partial(jax.jit, static_argnames=("epilogue", "config", "sms", "out_dtype", "interpret"))
def hopper_gemm(x: jax.Array, w: jax.Array, *, residual: jax.Array | None = None, epilogue: str = "none",
                x_scale: jax.Array | None = None, w_scale: jax.Array | None = None, out_dtype=None,
                row_tile_group: jax.Array | None = None, config: HopperConfig = HopperConfig(),
                sms: int | None = None, interpret: bool = False) -> jax.Array:
    """x [M, K] @ w[N, K].T with `epilogue` (see the module docstring); sms: CTAs of the persistent grid
    (default: the GPU's SM count). W8A8: x and w int8 or float8_e4m3fn, x_scale float32 [M], w_scale float32 [N],
    out_dtype the activations' dtype (the output's and the residual's). Grouped: w [G, N, K] and row_tile_group
    int32 [M / cta_m], the group of each CTA tile of rows (< 0: skipped, its rows unwritten); 16-bit operands,
    epilogue "none" or "swiglu"."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"hopper_gemm: unknown epilogue {epilogue!r}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("hopper_gemm: a residual goes with epilogue='residual'")
    grouped = row_tile_group is not None
    if grouped:
        if w.ndim != 3 or x.dtype in EIGHT_BIT or epilogue == "residual":
            raise ValueError(f"hopper_gemm: a grouped product takes a [G, N, K] stack of 16-bit weights and the "
                             f"'none' or 'swiglu' epilogue, not {w.shape} {w.dtype} {epilogue!r}")
        want = (x.shape[0] // cta_tile(config)[0],)
        if row_tile_group.shape != want or row_tile_group.dtype != jnp.int32:
            raise ValueError(f"hopper_gemm: row_tile_group {row_tile_group.shape} {row_tile_group.dtype}; want "
                             f"int32 {want} (a group a tile of {cta_tile(config)[0]} rows)")
    M, K = x.shape
    N, K2 = w.shape[-2:]
    if K != K2 or x.dtype != w.dtype:
        raise ValueError(f"hopper_gemm: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} do not match")
    scaled = x.dtype in EIGHT_BIT
    if scaled != (x_scale is not None and w_scale is not None and out_dtype is not None):
        raise ValueError(f"hopper_gemm: {x.dtype} operands take x_scale, w_scale and out_dtype (W8A8) "
                         "and other dtypes none")
    if scaled and (x_scale.shape != (M,) or w_scale.shape != (N,) or x_scale.dtype != f32 or w_scale.dtype != f32):
        raise ValueError(f"hopper_gemm: scales x {x_scale.shape} {x_scale.dtype}, w {w_scale.shape} "
                         f"{w_scale.dtype}; want float32 {(M,)} and {(N,)}")
    dtype = jnp.dtype(out_dtype) if scaled else x.dtype
    if not supported(M, N, K, epilogue, config):
        raise ValueError(f"hopper_gemm: ({M}, {N}, {K}) {epilogue} does not tile by {config}")
    cols = N // 2 if epilogue == "swiglu" else N
    if residual is not None and residual.shape != (M, cols):
        raise ValueError(f"hopper_gemm: residual {residual.shape} is not {(M, cols)}")
    sms = sms or num_sms()
    cta_m, cta_n = cta_tile(config)
    units = (M // cta_m) * (cols // cta_n)
    call = plgpu.kernel(
        functools.partial(_kernel, config=config, epilogue=epilogue, cols=cols, scaled=scaled, grouped=grouped),
        out_type=jax.ShapeDtypeStruct((M, cols), dtype),
        grid=(min(sms, units),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        kernel_name=f"hopper_gemm_{'grouped_' if grouped else ''}{'w8a8_' if scaled else ''}{epilogue}",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    args = ((x, w) + ((row_tile_group,) if grouped else ()) + ((x_scale, w_scale) if scaled else ())
            + ((residual,) if epilogue == "residual" else ()))
    return run_mosaic(call, *args, interpret=interpret)
