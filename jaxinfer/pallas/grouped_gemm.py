"""Grouped GEMM for a mixture of experts: y[r] = x[r] @ W[layer, group(r)].T over rows grouped by expert.

The work is a list of items (group, lo, hi): rows lo..hi-1 of x (at most block_m of them) belong to expert
`group`. Each program takes one item and `block_n` output columns (and with split K a share of the depth),
streams W[layer, group, n0:n0+block_n, :] in [block_n, block_k] tiles (software pipeline, `num_stages`) and
multiplies them with the item's rows on tensor cores (float32 accumulation); rows outside lo..hi are masked on
load and store, so two items may share a tile of rows. Only the experts that some row chose are read. W is the
stacked [L, E, N, K] array read in place at `layer` (a one-layer [E, N, K] stack as well).

Two schedules make the items (XLA, small arrays):
- sorted_items: the rows sorted by expert with group_sizes [E] (prompts, batched decode): each expert's rows
  cut at block_m boundaries of the sorted order; at most cdiv(M, block_m) + E - 1 items, the rest empty.
- row_items: one item a row, its expert given (a batch-1 decode step: top_k rows of one token, no sort).

Epilogues, rounding as the reference ops do: none (round to x.dtype); "swiglu": W is each expert's fused
[2I, K] gate/up matrix, the program for columns n also reads rows I + n, and writes silu(gate) * up [M, I].
With split K (split_k > 1) the programs write float32 partial sums that a small XLA epilogue adds and rounds.

W8A8 (`x_scale`, per-channel 8-bit experts): x's rows arrive quantized to the experts' format with a float32 scale a
row (ops.quantized.quantize_rows); the tiles multiply in 8 bits (int8 -> int32, exact; e4m3 -> float32 on wgmma
through fp8_dot.py, each tile's product added to a float32 accumulator, and the row tile at least 64 rows: below it
Triton's mma.sync has no e4m3 form), and the sums take the row's and then the channel's scale once, as XLA's W8A8
product (ops.pallas._w8a8) does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import fp8_dot, tables
from jaxinfer.pallas.blocks import (EIGHT_BIT, dot_precision, is_pow2, layer_operands, pow2_divisor, scale_shape,
                                     silu_mul, tile_mask, zero_fill)

f32 = jnp.float32
i32 = jnp.int32
EPILOGUES = ("none", "swiglu")
WGMMA_ROWS = 64   # e4m3 products on tensor cores need wgmma, whose tiles are 64 rows

GroupedGemmConfig = tables.GroupedGemmConfig
fp8_dot.install("grouped_gemm_")   # W8A8's e4m3 tile products on wgmma (fp8_dot.py)


def table_configs(assignments: int, E: int, two_i: int, D: int) -> tuple[GroupedGemmConfig, GroupedGemmConfig] | None:
    """(gate/up's, down's) measured configs for a block of `assignments` rows (tokens x top_k) over E experts of
    gate/up [two_i, D] and down [D, two_i / 2] (tables.GROUPED_GEMM), or None where the table lacks either product
    there or their block_m differ (both products run one item schedule)."""
    def lookup(key):
        return next((c for first, last, c in tables.GROUPED_GEMM.get(key, ()) if first <= assignments <= last), None)
    up, down = lookup((E, two_i, D, "swiglu")), lookup((E, D, two_i // 2, "none"))
    if up is None or down is None or up.block_m != down.block_m:
        return None
    return up, down


def choose_config(rows_per_group: float, N: int, K: int, epilogue: str = "none") -> GroupedGemmConfig:
    """A config for groups of about rows_per_group rows: items of the next power of two (16..128) rows; where
    there are few rows a group (decode), split K so that each expert's matrix is streamed by several programs.
    The rule where tables.GROUPED_GEMM has no row (table_configs); bench/kernels/moe.py sweeps it."""
    bm = 16
    while bm < 128 and bm < rows_per_group:
        bm *= 2
    split = 1
    if bm <= 16:
        while split < 4 and K // (64 * split) >= 8:
            split *= 2
    # float32 accumulators a thread: bm * bn (twice for SwiGLU's gate and up) over 32 * num_warps threads, <= 64
    wide = bm > 64 and epilogue != "swiglu"
    return GroupedGemmConfig(block_m=bm, block_n=128 if wide else 64, block_k=64, num_warps=4 if bm <= 64 else 8,
                             num_stages=3 if bm <= 64 else 2, split_k=split)


def max_items(M: int, num_groups: int, block_m: int) -> int:
    """The most items sorted_items can make: every tile of rows, plus one more at each boundary between groups."""
    return -(-M // block_m) + num_groups - 1


def sorted_items(group_sizes: jax.Array, M: int, block_m: int) -> jax.Array:
    """Items int32 [max_items, 3] (group, lo, hi) over M rows sorted by group (group_sizes [E], summing to at most
    M): each group's rows cut where they cross a multiple of block_m. Unused items are (0, 0, 0): empty."""
    E = group_sizes.shape[0]
    gs = group_sizes.astype(i32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    first = starts // block_m
    tiles = jnp.where(gs > 0, (ends - 1) // block_m - first + 1, 0)
    tile_ends = jnp.cumsum(tiles)
    W = max_items(M, E, block_m)
    w = jnp.arange(W, dtype=i32)
    # compare_all: one fusion; the default method is a loop, which XLA runs on the GPU with the host checking each
    # iteration (8 at 128 experts, ~6 us each in a traced batch-64 step)
    g = jnp.minimum(jnp.searchsorted(tile_ends, w, side="right", method="compare_all"), E - 1).astype(i32)
    tile = first[g] + w - (tile_ends[g] - tiles[g])
    lo = jnp.maximum(starts[g], tile * block_m)
    hi = jnp.minimum(ends[g], tile * block_m + block_m)
    valid = w < tile_ends[-1]
    return jnp.stack([jnp.where(valid, g, 0), jnp.where(valid, lo, 0), jnp.where(valid, hi, 0)], axis=1)


def row_items(groups: jax.Array) -> jax.Array:
    """Items int32 [R, 3]: row r alone, of expert groups[r] (groups [R])."""
    r = jnp.arange(groups.shape[0], dtype=i32)
    return jnp.stack([groups.astype(i32), r, r + 1], axis=1)


def _kernel(layer_ref, items_ref, x_ref, w_ref, *refs, M, N, K, cfg: GroupedGemmConfig, epilogue, half,
            tiles_per_split, w_block, BM, x_scaled=False):
    refs = list(refs)
    o_ref = refs.pop()
    ws_ref = refs.pop(0) if refs else None
    xs_ref = refs.pop(0) if x_scaled else None
    BN, BK, S = cfg.block_n, cfg.block_k, cfg.split_k
    item = pl.program_id(0)
    g = plgpu.load(items_ref.at[item, i32(0)])
    lo = plgpu.load(items_ref.at[item, i32(1)])
    hi = plgpu.load(items_ref.at[item, i32(2)])
    layer = plgpu.load(layer_ref.at[i32(0)])
    n0 = pl.program_id(1) * BN
    split = pl.program_id(2)   # (read outside pl.when: interpret mode cannot read it inside)

    @pl.when(hi > lo)
    def _():
        cols_n = half if epilogue == "swiglu" else N
        ragged_n = cols_n % BN != 0
        ragged_k = K % BK != 0 or (S > 1 and pl.cdiv(K, BK) % S != 0)
        rows = lo + jnp.arange(BM, dtype=i32)
        row_ok = rows < hi
        rows_ld = jnp.minimum(rows, M - 1)
        n = n0 + jnp.arange(BN, dtype=i32)
        n_ok = n < cols_n
        n_ld = jnp.minimum(n, cols_n - 1)
        lanes = jnp.arange(BK, dtype=i32)
        bases = (0, half) if epilogue == "swiglu" else (0,)
        prec = dot_precision(x_ref.dtype)
        acc_dtype = i32 if x_scaled and x_ref.dtype == jnp.int8 else f32     # int8 x int8: exact int32 sums
        k_tiles = pl.cdiv(K, BK)
        t_lo = split * tiles_per_split if S > 1 else 0
        t_hi = jnp.minimum(t_lo + tiles_per_split, k_tiles) if S > 1 else k_tiles

        def body(t, accs):
            k0 = pl.multiple_of(t * BK, BK)
            k = k0 + lanes
            k_ok = k < K
            kk = (jnp.minimum(k, K - 1) if ragged_k else k)[None, :]
            x = plgpu.load(x_ref.at[rows_ld[:, None], kk], mask=tile_mask(row_ok, k_ok if ragged_k else None,
                                                                          (BM, BK)), other=zero_fill(x_ref.dtype))
            w_mask = tile_mask(n_ok if ragged_n else None, k_ok if ragged_k else None, (BN, BK))
            out = []
            for base, acc in zip(bases, accs):
                if w_mask is None:
                    w = plgpu.load(w_ref.at[layer, g, pl.ds(base + n0, BN), pl.ds(k0, BK)])
                else:
                    w = plgpu.load(w_ref.at[layer, g, (base + n_ld)[:, None], kk], mask=w_mask,
                                   other=zero_fill(w_ref.dtype))
                if ws_ref is not None and not x_scaled:   # 8-bit values: exact in x's dtype
                    w = w.astype(x.dtype)
                prod = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=prec,
                                           preferred_element_type=acc_dtype)
                if w_block is not None:   # this depth tile's block scale of each column (the tile in one block)
                    bo, bi = w_block
                    prod = prod * plgpu.load(ws_ref.at[layer, g, (base + n_ld) // bo, k0 // bi])[None, :]
                out.append(acc + prod)
            return tuple(out)

        accs = jax.lax.fori_loop(t_lo, t_hi, body, tuple(jnp.zeros((BM, BN), acc_dtype) for _ in bases))
        if x_scaled:   # the rows' scales, once (masked rows: 0, as their sums)
            xs = plgpu.load(xs_ref.at[rows_ld], mask=row_ok, other=0.0)[:, None]
            accs = tuple(acc.astype(f32) * xs for acc in accs)
        if ws_ref is not None and w_block is None:   # each output channel's scale, once, after the sums
            accs = tuple(acc * plgpu.load(ws_ref.at[layer, g, base + n_ld])[None, :] for base, acc in zip(bases, accs))
        mask = row_ok[:, None] & n_ok[None, :]
        if S > 1:   # [S, M, N] float32 partial sums
            for base, acc in zip(bases, accs):
                plgpu.store(o_ref.at[split, rows[:, None], (base + n)[None, :]], acc, mask=mask)
            return
        ys = [acc.astype(o_ref.dtype) for acc in accs]
        y = silu_mul(*ys) if epilogue == "swiglu" else ys[0]
        plgpu.store(o_ref.at[rows[:, None], n[None, :]], y.astype(o_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("epilogue", "config", "w_block", "out_dtype", "interpret"))
def grouped_gemm(x: jax.Array, w: jax.Array, items: jax.Array, layer: jax.Array | int = 0, *,
                 epilogue: str = "none", config: GroupedGemmConfig | None = None, w_scale: jax.Array | None = None,
                 w_block: tuple[int, int] | None = None, x_scale: jax.Array | None = None, out_dtype=None,
                 interpret: bool = False) -> jax.Array:
    """x [M, K] @ W[layer, group].T for each item's rows: w [L, E, N, K] (or [E, N, K], one layer), items
    int32 [W, 3] (group, lo, hi) from sorted_items or row_items (an item holds at most config.block_m rows).
    Returns [M, N] in x's dtype ("swiglu": [M, N // 2], w each expert's [gate; up] rows); rows no item holds
    are left unwritten (undefined). config: None picks choose_config for M / E rows a group.
    8-bit w (int8, float8_e4m3fn values) takes w_scale: [L, E, N] one scale an output channel, applied to the
    float32 sums (as reference.grouped_linear); or with w_block (bo, bi) [L, E, ceil(N / bo), ceil(K / bi)], each
    depth tile's products times its block's scales (block_k is cut to divide bi). The values are converted to x's
    dtype (exact) on their way to the tensor cores.
    W8A8: x_scale float32 [M] with x in w's 8-bit dtype (per-channel w_scale only), out_dtype the activations' dtype
    (the output's); the tiles multiply in 8 bits (module docstring)."""
    if w.ndim == 3:
        w = w[None]
        w_scale = None if w_scale is None else w_scale[None]
    if w.ndim != 4 or x.ndim != 2:
        raise ValueError(f"grouped_gemm: x [M, K] and w [L, E, N, K], got {x.shape} and {w.shape}")
    M, K = x.shape
    _, E, N, K_w = w.shape
    if K_w != K:
        raise ValueError(f"grouped_gemm: x {x.shape} and w {w.shape} disagree on K")
    eight_bit = w.dtype in EIGHT_BIT
    if x_scale is not None:
        if not eight_bit or x.dtype != w.dtype or w_block is not None:
            raise ValueError(f"grouped_gemm: x_scale (W8A8) takes x in w's 8-bit dtype and per-channel w_scale, not "
                             f"x {x.dtype}, w {w.dtype}, block {w_block}")
        if x_scale.shape != (M,) or x_scale.dtype != f32 or out_dtype is None:
            raise ValueError(f"grouped_gemm: x_scale {x_scale.dtype} {x_scale.shape} should be float32 [{M}], with "
                             "out_dtype")
    elif out_dtype is not None and jnp.dtype(out_dtype) != x.dtype:
        raise ValueError(f"grouped_gemm: out_dtype {out_dtype} differs from x's {x.dtype} only with x_scale (W8A8)")
    elif not eight_bit and w.dtype != x.dtype:
        raise ValueError(f"grouped_gemm: x {x.dtype} and w {w.dtype} must share a dtype")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    want = scale_shape(w.shape, w_block) if eight_bit else None
    if (w_scale is None) != (want is None) or (w_scale is not None and w_scale.shape != want):
        raise ValueError(f"grouped_gemm: 8-bit weights take w_scale {want} (and only they); got w {w.dtype}, "
                         f"w_scale {None if w_scale is None else w_scale.shape}, block {w_block}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"grouped_gemm: unknown epilogue {epilogue!r}")
    if epilogue == "swiglu" and N % 2:
        raise ValueError(f"grouped_gemm: swiglu needs an even number of rows, got {N}")
    if items.ndim != 2 or items.shape[1] != 3:
        raise ValueError(f"grouped_gemm: items int32 [W, 3] (group, lo, hi), got {items.shape}")
    cfg = config or choose_config(M / E, N, K, epilogue)
    if w_block is not None and w_block[1] % cfg.block_k:   # a depth tile inside one block of columns
        cfg = dataclasses.replace(cfg, block_k=max(16, min(cfg.block_k, pow2_divisor(w_block[1]))))
        if w_block[1] % cfg.block_k:
            raise ValueError(f"grouped_gemm: block scales of {w_block[1]} columns take no depth tile of >= 16")
    if not (is_pow2(cfg.block_m) and is_pow2(cfg.block_n) and is_pow2(cfg.block_k) and cfg.block_m >= 16
            and cfg.block_n >= 16 and cfg.block_k >= 16 and cfg.split_k >= 1):
        raise ValueError(f"grouped_gemm: bad config {cfg}")
    half = N // 2
    cols = half if epilogue == "swiglu" else N
    k_tiles = -(-K // cfg.block_k)
    S = min(cfg.split_k, k_tiles)
    cfg = dataclasses.replace(cfg, split_k=S)
    tiles_per_split = -(-k_tiles // S)
    if S > 1:
        out_shape = jax.ShapeDtypeStruct((S, M, N), f32)
    else:
        out_shape = jax.ShapeDtypeStruct((M, cols), out_dtype)
    # e4m3 W8A8: the row tile padded to wgmma's (items keep cfg.block_m rows; the rows past an item's are masked)
    BM = max(cfg.block_m, WGMMA_ROWS) if x_scale is not None and x.dtype == jnp.float8_e4m3fn else cfg.block_m
    kernel = functools.partial(_kernel, M=M, N=N, K=K, cfg=cfg, epilogue="none" if S > 1 else epilogue,
                               half=half, tiles_per_split=tiles_per_split, w_block=w_block, BM=BM,
                               x_scaled=x_scale is not None)
    quant = [a for a in (w_scale, x_scale) if a is not None]
    y = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(items.shape[0], pl.cdiv(N if S > 1 else cols, cfg.block_n), S),
        interpret=interpret, name=f"grouped_gemm_{epilogue}" + ("_w8a8" if x_scale is not None else ""),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(layer_operands(layer)[0], items.astype(i32), x, w, *quant)
    if S > 1:
        y = jnp.sum(y, axis=0).astype(out_dtype)
        if epilogue == "swiglu":
            y = silu_mul(*jnp.split(y, 2, axis=-1))
    return y
