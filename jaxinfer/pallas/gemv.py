"""Decode GEMV: y [T, out] = x [T, in] @ w [out, in].T (+ b), T = 1..16, as a Pallas Triton kernel.

Warp-explicit style. The weight matrix stays [out, in] row-major, as loaded from the checkpoint; a
program owns `block_out` output rows and walks `in` in tiles of `block_in` columns, so the lanes
of a warp read consecutive weights of one row (16-byte loads when block_in / (32 * num_warps) >= 8
in bf16). Each program keeps a float32 accumulator tile [block_out, block_in] per token and reduces
it across lanes once, at the end. Ragged `out` and `in` are handled with masked loads and stores;
the weights are never padded or copied per call.

Split-K (`split_k > 1`) gives each row group several programs, each over an equal share of the
`in` tiles; they write float32 partial sums [split_k, T, out] and a small XLA epilogue sums them,
adds the bias and rounds. It buys parallelism for matrices with few rows (2,560) at the price of one
more kernel boundary (~1-2 us); the measured table in `choose_config` decides where it pays.

Every ref is passed whole (no BlockSpec) and indexed with power-of-two `pl.ds` windows: a BlockSpec
whose block spans a non-power-of-two dimension was seen to give silently wrong results on the GPU
(see ../shared/GPU_FACTS.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.ops import reference

f32 = jnp.float32

MAX_T = 16  # above this many tokens `linear` hands the product to XLA (a GEMM, not a GEMV)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_out: int = 4
    block_in: int = 512
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    unroll: bool = True  # straight-line code over the `in` tiles (else a fori_loop)

    def astuple(self):
        return dataclasses.astuple(self)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _gemv_kernel(x_ref, w_ref, *refs, T, n_out, n_in, block_out, block_in, tiles_per_split,
                 split_k, has_bias, unroll):
    if has_bias:
        b_ref, o_ref = refs
    else:
        (o_ref,) = refs
    row0 = pl.program_id(0) * block_out
    ragged_rows = n_out % block_out != 0
    rows = row0 + jnp.arange(block_out)
    row_mask = rows < n_out
    n_tiles = pl.cdiv(n_in, block_in)
    if split_k > 1:
        k_base = pl.program_id(1) * (tiles_per_split * block_in)
        # Tiles past `in` (the last split's share may overrun) are masked out entirely.
        every_tile_masked = n_tiles % split_k != 0 or n_in % block_in != 0
    else:
        k_base = 0
        every_tile_masked = False
    lanes = jnp.arange(block_in)

    def tile(k0, accs, masked):
        cmask = (k0 + lanes) < n_in if masked else None
        if ragged_rows and masked:
            wmask = row_mask[:, None] & cmask[None, :]
        elif ragged_rows:
            wmask = jnp.broadcast_to(row_mask[:, None], (block_out, block_in))
        elif masked:
            wmask = jnp.broadcast_to(cmask[None, :], (block_out, block_in))
        else:
            wmask = None
        if masked:  # index arrays: a static window past the end would be rejected at trace time
            cols = k0 + lanes
            w_win = w_ref.at[rows[:, None], cols[None, :]]
        else:
            w_win = w_ref.at[pl.ds(row0, block_out), pl.ds(k0, block_in)]
        if wmask is None:
            w = plgpu.load(w_win, eviction_policy="evict_first")
        else:
            w = plgpu.load(w_win, mask=wmask, other=0, eviction_policy="evict_first")
        w = w.astype(f32)
        out = []
        for t in range(T):
            ti = jnp.int32(t)  # a Python int index trips the interpreter's discharge rule
            x_win = x_ref.at[ti, cols] if masked else x_ref.at[ti, pl.ds(k0, block_in)]
            xt = plgpu.load(x_win) if cmask is None else plgpu.load(x_win, mask=cmask, other=0)
            out.append(accs[t] + w * xt.astype(f32)[None, :])
        return out

    accs = [jnp.zeros((block_out, block_in), f32) for _ in range(T)]
    if split_k > 1:
        n_local = tiles_per_split
        last_ragged = every_tile_masked
    else:
        n_local = n_tiles
        last_ragged = n_in % block_in != 0
    if unroll:
        for i in range(n_local):
            masked = every_tile_masked or (last_ragged and i == n_local - 1)
            accs = tile(k_base + i * block_in, accs, masked)
    else:
        n_full = n_local if every_tile_masked or not last_ragged else n_local - 1

        def body(i, accs):
            k0 = pl.multiple_of(k_base + i * block_in, block_in)
            return tuple(tile(k0, list(accs), every_tile_masked))

        accs = list(jax.lax.fori_loop(0, n_full, body, tuple(accs)))
        if n_full < n_local:
            accs = tile(k_base + n_full * block_in, accs, True)

    for t in range(T):
        y = jnp.sum(accs[t], axis=1)  # [block_out], float32
        if split_k > 1:
            dst = o_ref.at[pl.program_id(1), jnp.int32(t), pl.ds(row0, block_out)]
        else:
            if has_bias:
                bwin = b_ref.at[pl.ds(row0, block_out)]
                bias = plgpu.load(bwin, mask=row_mask, other=0) if ragged_rows else plgpu.load(bwin)
                y = y + bias.astype(f32)
            y = y.astype(o_ref.dtype)
            dst = o_ref.at[jnp.int32(t), pl.ds(row0, block_out)]
        if ragged_rows:
            plgpu.store(dst, y, mask=row_mask)
        else:
            plgpu.store(dst, y)


@functools.partial(jax.jit, static_argnames=("block_out", "block_in", "num_warps", "num_stages",
                                             "split_k", "unroll", "interpret"))
def gemv(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, block_out: int = 4,
         block_in: int = 512, num_warps: int = 4, num_stages: int = 1, split_k: int = 1,
         unroll: bool = True, interpret: bool = False) -> jax.Array:
    """x [T, in] @ w[out, in].T (+ b[out]) -> [T, out] in x.dtype, float32 accumulation.

    block_out and block_in must be powers of two; any `out` and `in` are accepted (masked).
    """
    T, n_in = x.shape
    n_out, n_in_w = w.shape
    if n_in_w != n_in:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} disagree on `in`")
    if b is not None and b.shape != (n_out,):
        raise ValueError(f"gemv: bias {b.shape} is not [{n_out}]")
    if not (_is_pow2(block_out) and _is_pow2(block_in)):
        raise ValueError(f"gemv: block_out={block_out}, block_in={block_in} must be powers of 2")
    n_tiles = pl.cdiv(n_in, block_in)
    split_k = max(1, min(split_k, n_tiles))
    tiles_per_split = pl.cdiv(n_tiles, split_k)
    split_k = pl.cdiv(n_tiles, tiles_per_split)  # no split left without work
    grid = (pl.cdiv(n_out, block_out), split_k)
    if split_k > 1:
        out_shape = jax.ShapeDtypeStruct((split_k, T, n_out), f32)
    else:
        out_shape = jax.ShapeDtypeStruct((T, n_out), x.dtype)
    kernel = functools.partial(
        _gemv_kernel, T=T, n_out=n_out, n_in=n_in, block_out=block_out, block_in=block_in,
        tiles_per_split=tiles_per_split, split_k=split_k,
        has_bias=b is not None and split_k == 1, unroll=unroll)
    args = (x, w) if (b is None or split_k > 1) else (x, w, b)
    y = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        interpret=interpret,
        name="gemv",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(*args)
    if split_k > 1:
        y = jnp.sum(y, axis=0)
        if b is not None:
            y = y + b.astype(f32)
        y = y.astype(x.dtype)
    return y


# Measured on one H200 (bench/kernels_gemv.py, bf16, T=1; see bench/NOTES.md). Keyed by (out, in);
# values are GemvConfig fields. Shapes not listed fall back to the heuristic in choose_config.
_TABLE: dict[tuple[int, int], GemvConfig] = {}


def choose_config(T: int, n_out: int, n_in: int, dtype) -> GemvConfig:
    """Block sizes for a [T, n_in] x [n_out, n_in] product: the measured table, else a heuristic."""
    cfg = _TABLE.get((n_out, n_in))
    itemsize = jnp.dtype(dtype).itemsize
    if cfg is None:
        block_in = 512 if itemsize == 2 else 256  # 16-byte lanes with 4 warps... 128 threads
        cfg = GemvConfig(block_out=4, block_in=block_in, num_warps=4, num_stages=1, split_k=1)
        if itemsize == 4 and cfg.block_in > 256:
            cfg = dataclasses.replace(cfg, block_in=256)
    # More tokens: more accumulators per lane. Keep T * block_out * block_in / lanes <= 64.
    while T * cfg.block_out * cfg.block_in > 64 * 32 * cfg.num_warps and cfg.block_in > 128:
        cfg = dataclasses.replace(cfg, block_in=cfg.block_in // 2)
    while T * cfg.block_out * cfg.block_in > 64 * 32 * cfg.num_warps and cfg.block_out > 1:
        cfg = dataclasses.replace(cfg, block_out=cfg.block_out // 2)
    return cfg


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           interpret: bool = False) -> jax.Array:
    """`reference.linear` with the Pallas GEMV for decode-sized T (<= MAX_T); XLA above that."""
    if x.ndim != 2 or x.shape[0] > MAX_T or x.shape[0] == 0:
        return reference.linear(x, w, b)
    cfg = choose_config(x.shape[0], w.shape[0], w.shape[1], w.dtype)
    return gemv(x, w, b, block_out=cfg.block_out, block_in=cfg.block_in, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, split_k=cfg.split_k, unroll=cfg.unroll,
                interpret=interpret)
