"""Decode GEMV: y [T, out] = x [T, in] @ w [out, in].T (+ b), T = 1..16, as a Pallas Triton kernel.

Measured (bench/NOTES.md): 77-83% of the HBM read ceiling at the 20-50 MB shapes, about
XLA's figure; 91-100% on matrices of 100 MB and more (gate/up, lm_head). At T > 1 it loses to XLA,
so `linear` sends only T = 1 here.

Warp-explicit style. The weight matrix stays [out, in] row-major, as loaded from the checkpoint; a
program owns `block_out` output rows and walks `in` in tiles of `block_in` columns, so the lanes
of a warp read consecutive weights of one row (16-byte loads when block_in / (32 * num_warps) >= 8
in bf16). Each program keeps a float32 accumulator tile [block_out, block_in] per token and reduces
it across lanes once, at the end. Ragged `out` and `in` are handled with masked loads and stores;
the weights are never padded or copied per call.

Split-K (`split_k > 1`) gives each row group several programs, each over an equal share of the
`in` tiles; they write float32 partial sums [split_k, T, out] and a small XLA epilogue sums them,
adds the bias and rounds. It buys parallelism for matrices with few rows (2,560) at the price of one
more kernel boundary (~1-2 us); measured, it never paid at batch 1 (one-row programs already give
2,560+ programs), so no table entry uses it.

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

from jaxinfer.pallas.blocks import is_pow2

from jaxinfer.ops import reference

f32 = jnp.float32

# `linear` uses the kernel up to this many tokens and XLA above. Measured (H200, 2026-11-29): at
# T=1 the kernel is on par with XLA; at T=8 (config from choose_config) it took 2-3x XLA's time,
# because every one-row program re-reads all T rows of x (T times the weight bytes through L1).
# `gemv` itself supports and is tested up to KERNEL_MAX_T tokens.
MAX_T = 1
KERNEL_MAX_T = 16


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_out: int = 1
    block_in: int = 256
    num_warps: int = 1
    num_stages: int = 1
    split_k: int = 1
    unroll: bool = True  # straight-line code over the `in` tiles (else a fori_loop)
    load_policy: str = "evict_first"  # weight loads: "evict_first" or "plain"

    def astuple(self):
        return dataclasses.astuple(self)


# (cache_modifier=".cg" would skip L1, but jax 0.11.2's Triton lowering cannot look it up.)
_LOAD_POLICIES = {"evict_first": dict(eviction_policy="evict_first"), "plain": {}}


def _gemv_kernel(x_ref, w_ref, *refs, T, n_out, n_in, block_out, block_in, tiles_per_split,
                 split_k, has_bias, unroll, load_policy):
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
        policy = _LOAD_POLICIES[load_policy]
        if wmask is None:
            w = plgpu.load(w_win, **policy)
        else:
            w = plgpu.load(w_win, mask=wmask, other=0, **policy)
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
                                             "split_k", "unroll", "load_policy", "interpret"))
def gemv(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, block_out: int = 1,
         block_in: int = 256, num_warps: int = 1, num_stages: int = 1, split_k: int = 1,
         unroll: bool = True, load_policy: str = "evict_first",
         interpret: bool = False) -> jax.Array:
    """x [T, in] @ w[out, in].T (+ b[out]) -> [T, out] in x.dtype, float32 accumulation.

    block_out and block_in must be powers of two; any `out` and `in` are accepted (masked).
    """
    T, n_in = x.shape
    n_out, n_in_w = w.shape
    if n_in_w != n_in:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} disagree on `in`")
    if b is not None and b.shape != (n_out,):
        raise ValueError(f"gemv: bias {b.shape} is not [{n_out}]")
    if not (is_pow2(block_out) and is_pow2(block_in)):
        raise ValueError(f"gemv: block_out={block_out}, block_in={block_in} must be powers of 2")
    if load_policy not in _LOAD_POLICIES:
        raise ValueError(f"gemv: load_policy {load_policy!r} not in {sorted(_LOAD_POLICIES)}")
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
        has_bias=b is not None and split_k == 1, unroll=unroll, load_policy=load_policy)
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


# Measured on one H200 (bench/kernels_gemv.py, bf16, T=1; bench/NOTES.md has the runs). Keyed by
# (out, in) for 2-byte dtypes. One warp per program and one row per program won almost everywhere:
# the most programs, so the most independent row streams in flight, and no cross-warp reduction.
_TABLE: dict[tuple[int, int], GemvConfig] = {
    (6144, 2560): GemvConfig(block_out=1, block_in=128, num_warps=1),     # Qwen3-4B qkv
    (19456, 2560): GemvConfig(block_out=1, block_in=512, num_warps=1),    # Qwen3-4B gate/up
    (2560, 9728): GemvConfig(block_out=1, block_in=128, num_warps=1),     # Qwen3-4B down
    # Qwen3-4B o_proj; block_in 128 (was 256): the fused kernel's registers 98 -> ~64 (32 blocks an SM, one wave;
    # ncu and bench/kernel_registers.py), batch-1 step 2.522 -> 2.493 and 2.517 -> 2.494 ms (twentieth session)
    (2560, 4096): GemvConfig(block_out=2, block_in=128, num_warps=1),
    (4096, 4096): GemvConfig(block_out=1, block_in=128, num_warps=1),     # Llama-3-8B o_proj
    (28672, 4096): GemvConfig(block_out=1, block_in=512, num_warps=1),    # Llama-3-8B gate/up
    (4096, 14336): GemvConfig(block_out=1, block_in=256, num_warps=1),    # Llama-3-8B down
    (151936, 2560): GemvConfig(block_out=1, block_in=256, num_warps=1),   # Qwen3-4B lm_head
}
# For shapes not in the table. In run 1 it was within 2% of the best at 5 of the 8 shapes and
# 16-35% behind at 6144x2560, 19456x2560 and 2560x4096: measure new shapes before relying on it.
_DEFAULT = GemvConfig(block_out=1, block_in=256, num_warps=1)


def choose_config(T: int, n_out: int, n_in: int, dtype) -> GemvConfig:
    """Block sizes for a [T, n_in] x [n_out, n_in] product: the measured table, else a default."""
    itemsize = jnp.dtype(dtype).itemsize
    cfg = _TABLE.get((n_out, n_in), _DEFAULT) if itemsize == 2 else None
    if cfg is None:  # 4-byte weights: the same 16-byte lanes hold half the elements
        cfg = GemvConfig(block_out=1, block_in=128, num_warps=1)
    # More tokens: more accumulators per lane. Keep T * block_out * block_in / lanes <= 64.
    while T * cfg.block_out * cfg.block_in > 64 * 32 * cfg.num_warps and cfg.block_in > 128:
        cfg = dataclasses.replace(cfg, block_in=cfg.block_in // 2)
    while T * cfg.block_out * cfg.block_in > 64 * 32 * cfg.num_warps and cfg.block_out > 1:
        cfg = dataclasses.replace(cfg, block_out=cfg.block_out // 2)
    return cfg


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *, max_t: int = MAX_T,
           interpret: bool = False) -> jax.Array:
    """`reference.linear` with the Pallas GEMV for T <= max_t (default MAX_T); XLA above that."""
    max_t = min(max_t, KERNEL_MAX_T)
    if x.ndim != 2 or x.shape[0] > max_t or x.shape[0] == 0:
        return reference.linear(x, w, b)
    cfg = choose_config(x.shape[0], w.shape[0], w.shape[1], w.dtype)
    return gemv(x, w, b, block_out=cfg.block_out, block_in=cfg.block_in, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, split_k=cfg.split_k, unroll=cfg.unroll,
                load_policy=cfg.load_policy, interpret=interpret)
