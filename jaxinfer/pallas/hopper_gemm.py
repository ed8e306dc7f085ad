"""Prompt-row GEMM on Hopper tensor cores through Mosaic GPU (wgmma + TMA), with fused epilogues.

y = x [M, K] @ w[N, K].T, bf16 inputs, float32 accumulation, then an epilogue, rounding as the
reference ops round (as skinny_gemm's epilogues do):
  "none":     round to x.dtype;
  "residual": round, then add residual [M, N] (reference.linear_residual);
  "swiglu":   w is the fused [2I, K] gate/up matrix; gate and up are each rounded, then
              silu_mul (reference.rms_norm_swiglu after its norm): [M, I].
The Triton GEMM from Pallas reached 61-76% of cuBLAS's rate at 1k prompt rows (bench/NOTES.md), too
slow to pay for its epilogues; this one is built the way Hopper GEMMs reach the tensor-core rate:
a persistent grid of one CTA an SM walking output tiles in a planar snake (L2 reuse of weight
tiles), a memory warpgroup streaming x and w tiles through a multi-stage shared-memory ring by TMA,
and two compute warpgroups (each tile_m of the CTA's 2 x tile_m rows) issuing wgmma on them. Both
compute warpgroups read the same weight tile: weights cross the bus once per CTA tile. The
weight tile is loaded as stored ([tile_n, tile_k], K-major) and handed to wgmma transposed.

Shapes must tile exactly (M and N by the CTA tile, `cta_tile`; K by tile_k); `supported` says whether they
do. `interpret=True` runs Mosaic GPU's interpret mode (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxinfer.pallas.blocks import run_mosaic, silu_mul

EPILOGUES = ("none", "residual", "swiglu")
f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    tile_m: int = 64        # rows per compute warpgroup (the CTA takes 2 x tile_m)
    tile_n: int = 128       # output columns per CTA (swiglu: gate and up columns each)
    tile_k: int = 64        # 64 bf16 = one 128-byte swizzled row
    stages: int = 4         # shared-memory ring depth
    epi_n: int = 64         # epilogue tile columns (rows: tile_m)
    snake_width: int = 8    # planar snake: tiles of this many along M before moving along N
    # The two compute warpgroups take the same tile_m rows and each its tile_n of the CTA's 2 x tile_n columns
    # (False: each its tile_m of 2 x tile_m rows, one tile_n of columns). For few rows (decode batches padded to
    # tile_m = 64 by the caller) the CTA then loads one x tile, and the grid spreads over the columns.
    split_n: bool = False
    # K split into this many ranges, each its own work unit of the persistent grid, writing float32 partial
    # products that XLA sums (then rounds, then adds the residual) in one fusion after the kernel. For products
    # with few column tiles (o_proj and down at decode rows: 2,560 columns), so that every SM streams weights.
    # Not with swiglu (its epilogue needs the whole sum).
    split_k: int = 1
    # Tried and removed (bench/NOTES.md, twenty-first session): the ring kept across a CTA's tiles (Mosaic GPU's
    # pipeline of pipelines) and one wgmma group left in flight. Neither was faster on the H200, and the second
    # gave wrong elements there (0.2% of them) that interpret mode, running programs one by one, cannot show.


# Prompt-row products where the kernel made the 1k prompt step faster than XLA's GEMM (cuBLAS) with the epilogue
# in XLA (H200, 2026-12-01, Qwen3-4B's shapes; bench/NOTES.md, twentieth and twenty-first sessions). The kernel
# bench alone misleads here: cuBLAS ran QKV in 44 us in the step's trace and 67 us in the bench. us a call in
# the step's trace / the kernel bench:
# (N, K, epilogue) -> ((first rows, last rows, config), ...). Absent: XLA's GEMM.
PREFILL_TABLE: dict[tuple[int, int, str], tuple[tuple[int, int, HopperConfig], ...]] = {
    (6144, 2560, "none"): ((1024, 1024, HopperConfig(64, 192, 64, 4)),),      # QKV 1k: bench 44.5 (64x128/5: 49.3)
    (19456, 2560, "swiglu"): ((1024, 1024, HopperConfig(64, 128, 64, 3)),     # gate/up 1k: bench 151.6 (128x64/3:
                                                                              # 155.2, 146.7 in the step)
                              (8192, 8192, HopperConfig(64, 128, 64, 3))),    # 8k: 1196 vs XLA 1280 (bench)
}


# Batched-decode rows (2..DECODE_ROWS), padded to DECODE_ROWS by the ops, on split_n configs:
# (N, K, epilogue) -> config. Empty: bench/kernels_hopper_skinny.py has not yet timed it on the GPU against the
# engine's skinny GEMM (twenty-first session); `throughput.py --hopper-decode-table` fills it for an A/B.
DECODE_ROWS = 64
DECODE_TABLE: dict[tuple[int, int, str], HopperConfig] = {}


def table_config(M: int, N: int, K: int, epilogue: str) -> HopperConfig | None:
    """The measured config for M prompt rows of this product, or None where XLA's GEMM is the faster."""
    for first, last, config in PREFILL_TABLE.get((N, K, epilogue), ()):
        if first <= M <= last and supported(M, N, K, epilogue, config):
            return config
    return None


def decode_config(N: int, K: int, epilogue: str) -> HopperConfig | None:
    """The measured config for a decode batch's rows of this product (run on DECODE_ROWS padded rows), or None."""
    config = DECODE_TABLE.get((N, K, epilogue))
    return config if config is not None and supported(DECODE_ROWS, N, K, epilogue, config) else None


def cta_tile(config: HopperConfig) -> tuple[int, int]:
    """(rows, columns) of a CTA's output tile: two warpgroups side by side along M, or along N (split_n)."""
    if config.split_n:
        return config.tile_m, 2 * config.tile_n
    return 2 * config.tile_m, config.tile_n


def supported(M: int, N: int, K: int, epilogue: str, config: HopperConfig) -> bool:
    cols = N // 2 if epilogue == "swiglu" else N
    cta_m, cta_n = cta_tile(config)
    return (M % cta_m == 0 and cols % cta_n == 0 and K % (config.tile_k * config.split_k) == 0
            and config.tile_n % config.epi_n == 0 and (epilogue != "swiglu" or N % 2 == 0)
            and config.split_k >= 1 and (config.split_k == 1 or epilogue != "swiglu"))


def _kernel(x_gmem, w_gmem, *refs, config: HopperConfig, epilogue: str, cols: int):
    """epilogue "none" with config.split_k > 1: out_gmem is [split_k, M, cols] float32 partial products."""
    res_gmem = refs[0] if epilogue == "residual" else None
    out_gmem = refs[-1]
    M, K = x_gmem.shape
    dtype = out_gmem.dtype
    tm, tn, tk, en = config.tile_m, config.tile_n, config.tile_k, config.epi_n
    cta_m, cta_n = cta_tile(config)
    S = config.split_k
    m_iters, n_iters, k_iters = M // cta_m, cols // cta_n, K // tk // S
    swizzle = plgpu.find_swizzle(tk * jnp.dtype(x_gmem.dtype).itemsize * 8)
    in_transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(x_gmem.dtype).itemsize)),
                     plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(en * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    n_w = 2 if epilogue == "swiglu" else 1     # weight tiles a step: gate and up, or the one matrix

    def pipeline(body, compute_context):
        w_spec = plgpu.BlockSpec((cta_n, tk), lambda k: (0, k), transforms=in_transforms, memory_space=plgpu.SMEM)
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, tk), lambda k: (0, k), transforms=in_transforms,
                                      memory_space=plgpu.SMEM)] + [w_spec] * n_w,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.stages,
            compute_context=compute_context)

    w_args = (w_gmem, w_gmem) if n_w == 2 else (w_gmem,)
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

        @plgpu.nd_loop((m_iters * n_iters * S,), collective_axes="sm")
        def _tile(info: plgpu.NDLoopInfo):
            (unit,) = info.index
            lin, s = unit // S, unit % S         # an output tile, and which of its K ranges
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), 0, config.snake_width)
            k_range = pl.ds(s * (k_iters * tk), k_iters * tk)
            out = out_gmem.at[s] if S > 1 else out_gmem
            cta_rows = pl.ds(m_idx * cta_m, cta_m)
            wg_rows = cta_rows if config.split_n else pl.ds(m_idx * cta_m + wg * tm, tm)
            wg_col0 = n_idx * cta_n + (wg * tn if config.split_n else 0)     # the warpgroup's first output column

            def compute_context(run):
                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((tm, tn), f32) for _ in range(n_w)])
                def _accs(accs):
                    run(accs)
                    ys = [acc[...].astype(dtype) for acc in accs]
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
                        plgpu.copy_smem_to_gmem(slot, out.at[wg_rows, out_cols])

            def mma(_, x_smem, *w_and_accs):
                w_smems, accs = w_and_accs[:n_w], w_and_accs[n_w]
                x_wg = x_smem if config.split_n else x_smem.at[pl.ds(wg * tm, tm)]
                for acc, w_smem in zip(accs, w_smems):
                    w_wg = w_smem.at[pl.ds(wg * tn, tn)] if config.split_n else w_smem
                    plgpu.wgmma(acc, x_wg, w_wg.T)
                plgpu.wgmma_wait(0)
                return accs

            col_slices = [pl.ds(n_idx * cta_n, cta_n)] + ([pl.ds(cols + n_idx * cta_n, cta_n)] if n_w == 2 else [])
            pipeline(mma, compute_context)(x_gmem.at[cta_rows, k_range], *[w_gmem.at[c, k_range] for c in col_slices],
                                           allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def reference(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, epilogue: str = "none") -> jax.Array:
    """The kernel's reference twin: the reference ops' products and residual add, the SwiGLU rounded as silu_mul
    rounds (XLA's own SwiGLU fusion keeps silu in float32 before the product)."""
    from jaxinfer.ops import reference as ref_ops

    if epilogue == "residual":
        return ref_ops.linear_residual(x, w, None, residual)
    if epilogue == "swiglu":
        return silu_mul(*jnp.split(ref_ops.linear(x, w), 2, axis=-1))
    return ref_ops.linear(x, w)


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


@functools.partial(jax.jit, static_argnames=("epilogue", "config", "sms", "interpret"))
def hopper_gemm(x: jax.Array, w: jax.Array, *, residual: jax.Array | None = None, epilogue: str = "none",
                config: HopperConfig = HopperConfig(), sms: int | None = None, interpret: bool = False) -> jax.Array:
    """x [M, K] @ w[N, K].T with `epilogue` (see the module docstring); sms: CTAs of the persistent grid
    (default: the GPU's SM count)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"hopper_gemm: unknown epilogue {epilogue!r}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("hopper_gemm: a residual goes with epilogue='residual'")
    M, K = x.shape
    N, K2 = w.shape
    if K != K2 or x.dtype != w.dtype:
        raise ValueError(f"hopper_gemm: x {x.shape} {x.dtype} and w {w.shape} {w.dtype} do not match")
    if not supported(M, N, K, epilogue, config):
        raise ValueError(f"hopper_gemm: ({M}, {N}, {K}) {epilogue} does not tile by {config}")
    cols = N // 2 if epilogue == "swiglu" else N
    if residual is not None and residual.shape != (M, cols):
        raise ValueError(f"hopper_gemm: residual {residual.shape} is not {(M, cols)}")
    sms = sms or num_sms()
    cta_m, cta_n = cta_tile(config)
    S = config.split_k
    units = (M // cta_m) * (cols // cta_n) * S
    kernel_epilogue = "none" if S > 1 else epilogue     # split K: the residual is added after the sum
    call = plgpu.kernel(
        functools.partial(_kernel, config=config, epilogue=kernel_epilogue, cols=cols),
        out_type=jax.ShapeDtypeStruct((S, M, cols), jnp.float32) if S > 1 else jax.ShapeDtypeStruct((M, cols), x.dtype),
        grid=(min(sms, units),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        kernel_name=f"hopper_gemm_{epilogue}" + (f"_split{S}" if S > 1 else ""),   # traces tell them apart
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    args = (x, w) + ((residual,) if kernel_epilogue == "residual" else ())
    y = run_mosaic(call, *args, interpret=interpret)
    if S == 1:
        return y
    # The products rounded to x.dtype before the residual add, as the other paths round them: reduce_precision,
    # because XLA may drop a cast's rounding inside a fusion (its excess precision) and add in float32.
    info = jnp.finfo(x.dtype)
    y = lax.reduce_precision(y.sum(0), exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(x.dtype)
    return y + residual if residual is not None else y
