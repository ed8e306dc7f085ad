"""Projections on tensor cores with fused epilogues: y [M, N] = epilogue(x [M, K] @ W[layer].T + b).

Made for a batched decode step (M = 2..MAX_T rows, one per sequence; every row in one tile).

At these M the product is bound by reading W once (8 GB per Qwen3-4B step), as at batch 1, but the
batch-1 GEMV (one warp per output row, CUDA-core FMAs) would re-read x per row and spend M times the
FMAs. Here each program owns `block_n` output columns and all M rows (padded to a 16-row tile),
streams W[layer, n0:n0+block_n, :] in [block_n, block_k] tiles through a software pipeline
(`num_stages`) and multiplies on tensor cores (tl.dot, float32 accumulation). Matrices with few
columns (N = 2,560: o_proj, down) give few programs; `split_k` then gives each column block several
programs over equal shares of K, which write float32 partial sums that a small XLA epilogue adds.
W is the stacked [L, N, K] array read in place at `layer` (no per-layer copy).

Epilogues, rounding as the reference ops do: none (round to x.dtype); "residual": round, then add
residual [M, N]; "swiglu": W is the fused [2I, K] gate/up matrix, the program for columns n also
reads rows I + n, and writes silu(gate) * up [M, I].

8-bit weights (int8 or float8_e4m3fn, `w_scale`): tiles of 1-byte values are converted to x's dtype in registers
(exact: every int8 and e4m3 value is a bf16) before the tensor-core product; a scale per output channel multiplies
the float32 sums once (split K: each partial, so the finish is unchanged); block scales multiply each tile's
product by its rows' scales, a tile lying inside one column block.

W8A8 (`x_scale`, per-channel 8-bit weights): x arrives quantized to the weights' format with a float32 scale a row
(ops.quantized.quantize_rows), the tiles multiply on 8-bit tensor cores (e4m3 x e4m3 summed in float32, int8 x int8
in int32, exact), and the sums are multiplied by the row's and the output channel's scales once. The weight tiles
then go from memory to the product unconverted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import fp8_dot, tables
from jaxinfer.pallas.blocks import (dot_precision, is_pow2, layer_operands, pow2_at_least, silu_mul, tile_mask,
                                     zero_fill)
from jaxinfer.pallas.fused_gemv import weights_to_f32
from jaxinfer.pallas.tables import SkinnyConfig

f32 = jnp.float32
i32 = jnp.int32

# `ops.pallas` sends 2..MAX_T token rows here when the table has the shape (XLA's GEMM otherwise,
# and above MAX_T; the batch-1 GEMV at 1).
MAX_T = 64
EPILOGUES = ("none", "residual", "swiglu")
SMEM_BYTES = 200 * 1024   # of the H200's 227 KB per block: what the pipeline's stages may take
fp8_dot.install("skinny_gemm_")   # W8A8's e4m3 tile products on wgmma (fp8_dot.py)


def table_config(M: int, N: int, K: int, epilogue: str = "none", eight_bit: bool = False) -> SkinnyConfig | None:
    """The measured config for this product, or None where XLA's GEMM measured as fast or faster. Rows
    17..32 take an M = 32 row where the table has one, else the M = 64 row. eight_bit: 1-byte weights' table."""
    if M > MAX_T:
        return None
    table = tables.SKINNY_GEMM_8BIT if eight_bit else tables.SKINNY_GEMM
    if M <= 16:
        return table.get((N, K, epilogue, 16))
    if M <= 32 and (N, K, epilogue, 32) in table:
        return table[(N, K, epilogue, 32)]
    return table.get((N, K, epilogue, 64))


def choose_config(M: int, N: int, K: int, epilogue: str = "none") -> SkinnyConfig:
    """The table's config; elsewhere enough programs to keep every SM streaming (split K when the
    column blocks alone are few)."""
    cfg = table_config(M, N, K, epilogue)
    if cfg is not None:
        return cfg
    cols = N // 2 if epilogue == "swiglu" else N
    block_n = 64
    blocks = -(-cols // block_n)
    split = 1
    while blocks * split < 132 and split < 8 and -(-K // 128) >= 4 * split * 2:
        split *= 2
    return SkinnyConfig(block_n=block_n, block_k=128, num_warps=4, num_stages=4, split_k=split)


def splits(cfg: SkinnyConfig, K: int) -> int:
    """How many K ranges the config runs (never more than there are k tiles); above 1 the kernel writes
    float32 partial sums."""
    return min(cfg.split_k, -(-K // cfg.block_k))


def block_rows(M: int, e4m3_products: bool = False) -> int:
    """Rows of the one tile: all M rows padded to a power of two >= 16; >= 64 for e4m3 x e4m3 products (W8A8 on fp8
    weights), whose only tensor-core path on Hopper is wgmma, 64 rows a warpgroup: Triton runs a smaller tile's e4m3
    product as float16 mma.sync, both operands converted (read offline: 16 rows, HMMA and F2FP)."""
    return max(pow2_at_least(M, 16), 64 if e4m3_products else 16)


def fit_stages(cfg: SkinnyConfig, M: int, itemsize: int, epilogue: str, e4m3_products: bool = False) -> SkinnyConfig:
    """Fewer pipeline stages where the tiles of M rows would overflow shared memory (M = 128 with
    4 stages of 64 x 128 did, on the H200)."""
    BM = block_rows(M, e4m3_products)
    n_w = 2 if epilogue == "swiglu" else 1
    per_stage = (BM + n_w * cfg.block_n) * cfg.block_k * itemsize
    stages = max(1, min(cfg.num_stages, SMEM_BYTES // per_stage))
    return dataclasses.replace(cfg, num_stages=stages)


def _kernel(layer_ref, vlayer_ref, x_ref, w_ref, *refs, M, N, K, BM, cfg: SkinnyConfig, has_bias, epilogue, half,
            tiles_per_split, w_scaled=False, w_block=None, x_scaled=False):
    refs = list(refs)
    o_ref = refs.pop()
    ws_ref = refs.pop(0) if w_scaled else None
    xs_ref = refs.pop(0) if x_scaled else None
    b_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if epilogue == "residual" else None
    BN, BK, S = cfg.block_n, cfg.block_k, cfg.split_k
    partial = S > 1   # split-K: float32 partial sums out, the XLA epilogue finishes
    layer = plgpu.load(layer_ref.at[i32(0)])
    vlayer = plgpu.load(vlayer_ref.at[i32(0)])    # the bias's layer
    m0 = pl.program_id(0) * BM
    n0 = pl.program_id(1) * BN
    cols_n = half if epilogue == "swiglu" else N      # output columns this kernel covers
    ragged_n = cols_n % BN != 0
    ragged_k = K % BK != 0 or (S > 1 and pl.cdiv(K, BK) % S != 0)
    rows = m0 + jnp.arange(BM, dtype=i32)
    row_ok = rows < M
    rows_ld = jnp.minimum(rows, M - 1)
    n = n0 + jnp.arange(BN, dtype=i32)
    n_ok = n < cols_n
    n_ld = jnp.minimum(n, cols_n - 1)
    lanes = jnp.arange(BK, dtype=i32)
    bases = (0, half) if epilogue == "swiglu" else (0,)
    prec = dot_precision(x_ref.dtype)
    int_dot = x_scaled and x_ref.dtype == jnp.int8          # int8 x int8: exact int32 sums
    acc_dtype = i32 if int_dot else f32
    k_tiles = pl.cdiv(K, BK)
    t_lo = pl.program_id(2) * tiles_per_split if partial else 0
    t_hi = jnp.minimum(t_lo + tiles_per_split, k_tiles) if partial else k_tiles

    def body(t, accs):
        k0 = pl.multiple_of(t * BK, BK)
        k = k0 + lanes
        k_ok = k < K
        kk = (jnp.minimum(k, K - 1) if ragged_k else k)[None, :]
        x_mask = tile_mask(row_ok if M % BM else None, k_ok if ragged_k else None, (BM, BK))
        x = plgpu.load(x_ref.at[rows_ld[:, None], kk], mask=x_mask, other=None if x_mask is None else zero_fill(x_ref.dtype))
        w_mask = tile_mask(n_ok if ragged_n else None, k_ok if ragged_k else None, (BN, BK))
        out = []
        for base, acc in zip(bases, accs):
            if w_mask is None:
                w = plgpu.load(w_ref.at[layer, pl.ds(base + n0, BN), pl.ds(k0, BK)])
            else:
                w = plgpu.load(w_ref.at[layer, (base + n_ld)[:, None], kk], mask=w_mask, other=zero_fill(w_ref.dtype))
            if w_scaled and not x_scaled:   # exact: int8 through float32 as the GEMV converts it
                w = (weights_to_f32(w, tables.GEMV_INT8_CONVERT) if w.dtype == jnp.int8 else w).astype(x.dtype)
            y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=acc_dtype)
            if w_block is not None:   # the tile's block scales, one a row of W
                bo, bi = w_block
                y = y * plgpu.load(ws_ref.at[layer, (base + n_ld) // bo, k0 // bi])[None, :]
            out.append(acc + y)
        return tuple(out)

    accs = jax.lax.fori_loop(t_lo, t_hi, body, tuple(jnp.zeros((BM, BN), acc_dtype) for _ in bases))
    if x_scaled:   # the rows' scales, once (masked rows: 0, as their sums)
        xs = plgpu.load(xs_ref.at[rows_ld], mask=row_ok, other=0.0)[:, None]
        accs = tuple(acc.astype(f32) * xs for acc in accs)
    if w_scaled and w_block is None:   # the output channels' scales, once
        accs = tuple(acc * plgpu.load(ws_ref.at[layer, base + n_ld])[None, :] for base, acc in zip(bases, accs))
    mask = row_ok[:, None] & n_ok[None, :]
    if partial:   # [S, M, N_full]
        s = pl.program_id(2)
        for base, acc in zip(bases, accs):
            plgpu.store(o_ref.at[s, rows[:, None], (base + n)[None, :]], acc, mask=mask)
        return
    dtype = o_ref.dtype
    ys = []
    for base, acc in zip(bases, accs):
        if has_bias:
            acc = acc + plgpu.load(b_ref.at[vlayer, base + n_ld], mask=n_ok, other=0).astype(f32)[None, :]
        ys.append(acc.astype(dtype))
    if epilogue == "residual":
        y = ys[0] + plgpu.load(res_ref.at[rows_ld[:, None], n_ld[None, :]], mask=mask, other=0)
    elif epilogue == "swiglu":
        y = silu_mul(*ys)
    else:
        y = ys[0]
    plgpu.store(o_ref.at[rows[:, None], n[None, :]], y.astype(dtype), mask=mask)


def finish_partials(partial, b, residual, epilogue, dtype):
    """The split-K epilogue in XLA: sum the partials, then as the reference ops round."""
    y = jnp.sum(partial, axis=0)
    if b is not None:
        y = y + b.astype(f32)
    y = y.astype(dtype)
    if epilogue == "residual":
        return residual + y
    if epilogue == "swiglu":
        return silu_mul(*jnp.split(y, 2, axis=-1))
    return y


@functools.partial(jax.jit, static_argnames=("epilogue", "config", "finish", "w_block", "out_dtype", "interpret"))
def skinny_gemm(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, *, b: jax.Array | None = None,
                residual: jax.Array | None = None, epilogue: str = "none", config: SkinnyConfig | None = None,
                vector_layer: jax.Array | int | None = None, finish: bool = True,
                w_scale: jax.Array | None = None, w_block: tuple[int, int] | None = None,
                x_scale: jax.Array | None = None, out_dtype=None, interpret: bool = False) -> jax.Array:
    """x [M, K]; w [L, N, K] read at `layer` (2-D w and 1-D b count as one layer); b [Lb, N] read at
    `vector_layer` (default `layer`);
    epilogue "residual" adds residual [M, N]; "swiglu" takes w as [2I, K] (gate rows, then up) and
    returns [M, I]. config: None picks `choose_config`. finish=False (epilogue "none", no bias): a
    split-K config's float32 partial sums [S, M, N] as they are, for a fused finish elsewhere
    (residual_norm.py); the rounded product where the config does not split.
    8-bit w (int8, float8_e4m3fn) comes with w_scale, read at `layer` like w: float32 [L, N] per output channel, or
    [L, ceil(N / bo), ceil(K / bi)] with w_block = (bo, bi) (block_k is then cut to divide bi).
    W8A8: x_scale float32 [M], x in w's 8-bit dtype (per-channel w_scale only), out_dtype the activations' dtype
    (the output's and the residual's; default x.dtype otherwise). out_dtype float32 without x_scale: the sums (and
    scales) unrounded, as a lm_head's logits."""
    if x_scale is not None:
        if x.dtype != w.dtype or w.dtype.itemsize != 1 or w_scale is None or w_block is not None:
            raise ValueError(f"skinny_gemm: x_scale (W8A8) takes x in w's 8-bit dtype and per-channel w_scale, not x "
                             f"{x.dtype}, w {w.dtype}, w_block {w_block}")
        if x_scale.shape != (x.shape[0],) or x_scale.dtype != f32 or out_dtype is None:
            raise ValueError(f"skinny_gemm: x_scale {x_scale.dtype} {x_scale.shape} should be float32 [{x.shape[0]}], "
                             "with out_dtype given")
    elif out_dtype is not None and jnp.dtype(out_dtype) not in (x.dtype, jnp.dtype(f32)):
        raise ValueError(f"skinny_gemm: out_dtype {out_dtype}: x's {x.dtype} or float32 (the sums unrounded), or "
                         "another only with x_scale (W8A8)")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if w.ndim == 2:
        w = w[None]
        w_scale = None if w_scale is None else w_scale[None]
    if (w.dtype.itemsize == 1) != (w_scale is not None):
        raise ValueError(f"skinny_gemm: 8-bit weights go with their w_scale, and only they ({w.dtype})")
    if w_scale is not None:
        want = (w.shape[0], *(-(-d // b) for d, b in zip(w.shape[1:], w_block))) if w_block else w.shape[:2]
        if w_scale.shape != want:
            raise ValueError(f"skinny_gemm: w_scale {w_scale.shape} for w {w.shape} (block {w_block}) should be {want}")
    if b is not None and b.ndim == 1:
        b, vector_layer = b[None], 0
    M, K = x.shape
    if M > MAX_T:
        raise ValueError(f"skinny_gemm: {M} rows, more than MAX_T = {MAX_T}")
    _, N, K_w = w.shape
    if K_w != K:
        raise ValueError(f"skinny_gemm: x {x.shape} and w {w.shape} disagree on K")
    if epilogue not in EPILOGUES:
        raise ValueError(f"skinny_gemm: unknown epilogue {epilogue!r}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("skinny_gemm: a residual goes with epilogue='residual'")
    if not finish and (epilogue != "none" or b is not None):
        raise ValueError("skinny_gemm: finish=False returns the bare partial sums (epilogue 'none', no bias)")
    if epilogue == "swiglu" and N % 2:
        raise ValueError(f"skinny_gemm: swiglu needs an even number of rows, got {N}")
    cfg = config or choose_config(M, N, K, epilogue)
    if w_block is not None:
        cfg = dataclasses.replace(cfg, block_k=max(16, min(cfg.block_k, w_block[1] & -w_block[1])))
        if w_block[1] % cfg.block_k:
            raise ValueError(f"skinny_gemm: scale blocks of {w_block[1]} columns need a multiple of 16")
    e4m3_products = x_scale is not None and x.dtype == jnp.float8_e4m3fn
    cfg = fit_stages(cfg, M, x.dtype.itemsize, epilogue, e4m3_products)
    if not (is_pow2(cfg.block_n) and is_pow2(cfg.block_k) and cfg.block_n >= 16 and cfg.block_k >= 16
            and cfg.split_k >= 1):
        raise ValueError(f"skinny_gemm: bad config {cfg}")
    half = N // 2
    cols = half if epilogue == "swiglu" else N
    BM = block_rows(M, e4m3_products)
    k_tiles = -(-K // cfg.block_k)
    S = splits(cfg, K)
    cfg = dataclasses.replace(cfg, split_k=S)
    tiles_per_split = -(-k_tiles // S)
    partial = S > 1
    layers = layer_operands(layer, vector_layer)
    quant = [a for a in (w_scale, x_scale) if a is not None]
    if partial:
        args, out_shape = [*layers, x, w, *quant], jax.ShapeDtypeStruct((S, M, N), f32)
    else:
        args = [*layers, x, w, *quant] + [a for a in (b, residual) if a is not None]
        out_shape = jax.ShapeDtypeStruct((M, cols), out_dtype)
    kernel = functools.partial(_kernel, M=M, N=N, K=K, BM=BM, cfg=cfg, has_bias=b is not None and not partial,
                               epilogue="none" if partial else epilogue, half=half,
                               tiles_per_split=tiles_per_split, w_scaled=w_scale is not None, w_block=w_block,
                               x_scaled=x_scale is not None)
    y = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(M, BM), pl.cdiv(N if partial else cols, cfg.block_n), S),
        interpret=interpret,
        name=f"skinny_gemm_{epilogue}" + ("_w8a8" if x_scale is not None else "_8bit" if w_scale is not None else ""),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(*args)
    if partial and finish:
        return finish_partials(y, None if b is None else b[layers[1][0]], residual, epilogue, out_dtype)
    return y
