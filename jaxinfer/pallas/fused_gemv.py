"""Decode projections with their neighbours fused in: one kernel per projection, none between.

    y = epilogue( rms_norm(x) @ W[layer].T + b )     epilogue: none | + residual | SwiGLU

It also serves the lm_head at batch 1 with float32 outputs (`out_dtype`): on the H200 it reads Qwen3-4B's
778 MB matrix in 175 us a call where XLA's reduce fusions took 184 (floor 174).

One warp per program (measured best), the warp's lanes streaming consecutive weights of a row in tiles of
`block_in` (tables.GEMV_BLOCK_IN); one output row per program, or `rows` of them where tables.GEMV_ROWS says
(each row still its own vector, summed as a one-row program sums it: the same outputs). The weight matrix
stays [out, in] row-major, as loaded from the checkpoint, and is never padded or copied per call.
What is fused:
- the layer index: W is the stacked [L, out, in] array, read in place (no slice copy);
- RMSNorm as a prologue, without a second pass over x: rms_norm(x) . w = rsqrt(mean(x^2) + eps) *
  ((x * scale) . w), and the sum of squares accumulates from the same x tiles the dot loads;
- the residual add (round the projection to x.dtype, then add, as transformers does);
- SwiGLU: the program for row r also reads row r + I of the fused [2I, D] gate/up matrix and
  writes silu(gate) * up.

8-bit weights (int8 or float8_e4m3fn, `w_scale`): the same kernel streams the 1-byte values (half the bytes of
a bf16 step; every int8 and e4m3 value is exact in float32) and sums value * x in float32. A scale per output
channel multiplies each row's sum once, after the reduction; block scales ((bo, bi) blocks, the official FP8
checkpoints' format) multiply each tile of the row, a tile lying inside one bi-column block, or a tile of several
blocks held as [blocks, bi] with a scale a row. The fusions stay:
a quantized layer runs as many kernels as a bf16 one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import (INT8_CONVERTS, int8_bits_to_f32, layer_operands, pow2_divisor,
                                     resolve_int8_convert, row_tiles, scale_shape, silu_mul)

f32 = jnp.float32
MAX_T = 1  # decode tokens per call (above 1 token XLA's GEMM won: every one-row program re-reads all T rows of x)


# int8 -> float32 for four values packed in one 32-bit register: flip the sign bits (v + 128, as bytes 0..255), then
# one byte permute a value builds the float 2^23 + v + 128 (the byte in the low mantissa bits under 0x4B's exponent).
_PRMT_INT8X4 = """{
.reg .b32 t;
xor.b32 t, $4, 0x80808080;
prmt.b32 $0, t, 0x4B000000, 0x7540;
prmt.b32 $1, t, 0x4B000000, 0x7541;
prmt.b32 $2, t, 0x4B000000, 0x7542;
prmt.b32 $3, t, 0x4B000000, 0x7543;
}"""


def weights_to_f32(w, int8_convert: str = "cvt"):
    """Weights to float32, exactly. e4m3 through float16 (on Hopper two values an instruction). int8 "cvt": the
    conversion instruction (I2F runs at a quarter of the FMA rate: near 4.5 TB/s of int8 that is the GEMV's limit);
    "bits": v + 128 (0..255) placed in the low mantissa bits of 2^23, which is then subtracted with the 128:
    float(bits(2^23) + v + 128) - (2^23 + 128) = v, in integer adds and one float add; "prmt": the same float built
    by one byte permute a value on four values a register (inline PTX, _PRMT_INT8X4; blocks.resolve_int8_convert makes
    it "cvt", whose values are the same, in interpret mode)."""
    if w.dtype == jnp.float8_e4m3fn:
        w = w.astype(jnp.float16)
    elif w.dtype == jnp.int8 and int8_convert == "bits":
        return int8_bits_to_f32(w)
    elif w.dtype == jnp.int8 and int8_convert == "prmt":
        (biased,) = plgpu.elementwise_inline_asm(_PRMT_INT8X4, args=[w], constraints="=r,=r,=r,=r,r", pack=4,
                                                 result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, f32)])
        return biased - 8388736.0
    return w.astype(f32)


def _kernel(layer_ref, vlayer_ref, x_ref, w_ref, *refs, T, n_in, block_in, has_scale, has_bias, epilogue, eps, half,
            rows, w_scaled, w_block, int8_convert, interpret):
    refs = list(refs)
    o_ref = refs.pop()
    ws_ref = refs.pop(0) if w_scaled else None
    scale_ref = refs.pop(0) if has_scale else None
    b_ref = refs.pop(0) if has_bias else None
    res_ref = refs.pop(0) if epilogue == "residual" else None
    layer, vlayer = layer_ref[0], vlayer_ref[0]   # the matrix's layer, the vectors' (scale, bias)
    # `rows` consecutive output rows a program share each tile's x (and scale) loads; each row is its own
    # [block_in] vector, summed exactly as a one-row program sums it (the same outputs, bit for bit)
    first = pl.program_id(0) * rows
    out_rows = [first + r for r in range(rows)]
    # swiglu: gate rows, then up rows
    w_rows = out_rows + [r + half for r in out_rows] if epilogue == "swiglu" else out_rows
    # tiles wider than a scale block (block_in > bi) are [block_in / bi, bi]: one row of the tile a scale block
    wide = w_block is not None and block_in > w_block[1]
    tile = (block_in // w_block[1], w_block[1]) if wide else (block_in,)
    accs = [[jnp.zeros(tile, f32) for _ in w_rows] for _ in range(T)]
    sumsq = [jnp.zeros(tile, f32) for _ in range(T)]
    for k0, (idx, cmask) in zip(range(0, n_in, block_in), row_tiles(n_in, block_in)):
        if wide:
            idx = k0 + jnp.arange(tile[0])[:, None] * tile[1] + jnp.arange(tile[1])[None, :]
            cmask = None if k0 + block_in <= n_in else idx < n_in

        def load(ref_win, cmask=cmask):
            if cmask is not None:
                # float8 refs take a float fill (the lowering casts no integer to float8)
                return plgpu.load(ref_win, mask=cmask, other=0.0 if ref_win.dtype == jnp.float8_e4m3fn else 0)
            return plgpu.load(ref_win)

        ws = [weights_to_f32(load(w_ref.at[layer, r, idx]), int8_convert) for r in w_rows]
        if w_block is not None:   # this tile's block scales, one a row (wide tiles: one a row of the tile)
            bo, bi = w_block
            if wide:
                blocks = k0 // bi + jnp.arange(tile[0])
                n_blocks = -(-n_in // bi)
                ws = [w * plgpu.load(ws_ref.at[layer, r // bo, jnp.minimum(blocks, n_blocks - 1)])[:, None]
                      for w, r in zip(ws, w_rows)]
            else:
                ws = [w * ws_ref[layer, r // bo, k0 // bi] for w, r in zip(ws, w_rows)]
        scale = load(scale_ref.at[vlayer, idx]).astype(f32) if has_scale else None
        for t in range(T):
            xt = load(x_ref.at[jnp.int32(t), idx]).astype(f32)
            if has_scale:
                sumsq[t] = sumsq[t] + xt * xt
                xt = xt * scale
            accs[t] = [a + w * xt for a, w in zip(accs[t], ws)]
    dtype = o_ref.dtype
    for t in range(T):
        ys = [jnp.sum(a) for a in accs[t]]
        if w_scaled and w_block is None:   # the output channel's scale, once
            ys = [y * ws_ref[layer, r] for y, r in zip(ys, w_rows)]
        if has_scale:
            inv = jax.lax.rsqrt(jnp.sum(sumsq[t]) / n_in + eps)
            ys = [y * inv for y in ys]
        if has_bias:
            ys = [y + b_ref[vlayer, r].astype(f32) for y, r in zip(ys, w_rows)]
        ys = [y.astype(dtype) for y in ys]  # the projection rounds here, as in the reference
        for j, row in enumerate(out_rows):
            if epilogue == "residual":
                out = ys[j] + res_ref[jnp.int32(t), row]
            elif epilogue == "swiglu":
                out = silu_mul(ys[j], ys[rows + j])   # gate, up
            else:
                out = ys[j]
            o_ref[jnp.int32(t), row] = out.astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "epilogue", "block_in", "rows", "out_dtype", "w_block",
                                             "int8_convert", "num_warps", "interpret"))
def fused_gemv(x: jax.Array, w: jax.Array, layer: jax.Array | int = 0, *, scale: jax.Array | None = None,
               eps: float = 1e-6, b: jax.Array | None = None, residual: jax.Array | None = None,
               epilogue: str = "none", block_in: int = 256, rows: int = 1, out_dtype=None,
               vector_layer: jax.Array | int | None = None, w_scale: jax.Array | None = None,
               w_block: tuple[int, int] | None = None, int8_convert: str | None = None, num_warps: int = 1,
               interpret: bool = False) -> jax.Array:
    """x [T, in]; w [L, out, in] read at `layer`; scale [Lv, in] turns on the RMSNorm prologue; b [Lv, out]
    (both read at `vector_layer`, default `layer`: split weights keep their vectors stacked; 2-D w, 1-D
    scale and b are taken as one layer); epilogue "residual" adds residual
    [T, out]; "swiglu" treats w as [2I, in] (gate rows, then up) and returns [T, I].
    T <= a few tokens; block_in a power of two; `rows` output rows per program (a power of two that divides
    the output rows; the outputs do not depend on it). The output is in `out_dtype` (default x.dtype):
    float32 keeps the float32 sums unrounded (the lm_head's logits).
    8-bit w (int8, float8_e4m3fn) comes with w_scale, read at `layer` like w: float32 [L, out] per output channel, or
    [L, ceil(out / bo), ceil(in / bi)] with w_block = (bo, bi) (then block_in divides bi, or is a multiple of it:
    tiles of block_in / bi rows of bi). int8_convert: how
    int8 values become float32 (INT8_CONVERTS, weights_to_f32; None: int8_convert_for's). num_warps: warps a
    program (1, measured best for 2-byte weights; 1-byte weights' tiles may span several, warps_for)."""
    if w.ndim == 2:
        w = w[None]
        w_scale = None if w_scale is None else w_scale[None]
    if (w.dtype.itemsize == 1) != (w_scale is not None):
        raise ValueError(f"fused_gemv: 8-bit weights go with their w_scale, and only they ({w.dtype})")
    if int8_convert not in (None, *INT8_CONVERTS):
        raise ValueError(f"fused_gemv: int8_convert is one of {INT8_CONVERTS}, not {int8_convert!r}")
    if w_scale is not None:
        want = scale_shape(w.shape, w_block)
        if w_scale.shape != want:
            raise ValueError(f"fused_gemv: w_scale {w_scale.shape} for w {w.shape} (block {w_block}) should be {want}")
        if w_block is not None and w_block[1] % block_in and block_in % w_block[1]:
            raise ValueError(f"fused_gemv: block_in {block_in} must divide the scale blocks' {w_block[1]} columns or "
                             "be a multiple of them")
    vectors = [a for a in (scale, b) if a is not None]
    if any(a.ndim == 1 for a in vectors):   # one layer's vectors: a one-layer stack
        if not all(a.ndim == 1 for a in vectors):
            raise ValueError("fused_gemv: scale and b are both one layer's or both stacked")
        scale, b, vector_layer = None if scale is None else scale[None], None if b is None else b[None], 0
    T, n_in = x.shape
    _, n_out, n_in_w = w.shape
    if n_in_w != n_in:
        raise ValueError(f"fused_gemv: x {x.shape} and w {w.shape} disagree on `in`")
    if epilogue not in ("none", "residual", "swiglu"):
        raise ValueError(f"fused_gemv: unknown epilogue {epilogue!r}")
    if (epilogue == "residual") != (residual is not None):
        raise ValueError("fused_gemv: a residual goes with epilogue='residual'")
    if out_dtype is not None and epilogue != "none":
        raise ValueError("fused_gemv: out_dtype goes with epilogue='none' (the epilogues round to x.dtype)")
    half = n_out // 2
    grid_rows = half if epilogue == "swiglu" else n_out
    if rows < 1 or rows & (rows - 1) or grid_rows % rows:
        raise ValueError(f"fused_gemv: rows per program ({rows}) must be a power of two dividing {grid_rows}")
    args = [*layer_operands(layer, vector_layer), x, w] + [a for a in (w_scale, scale, b, residual) if a is not None]
    kernel = functools.partial(_kernel, T=T, n_in=n_in, block_in=block_in, has_scale=scale is not None,
                               has_bias=b is not None, epilogue=epilogue, eps=eps, half=half, rows=rows,
                               w_scaled=w_scale is not None, w_block=w_block,
                               int8_convert=resolve_int8_convert(int8_convert or int8_convert_for(grid_rows, n_in),
                                                                 interpret), interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, grid_rows), x.dtype if out_dtype is None else out_dtype),
        grid=(grid_rows // rows,),
        interpret=interpret,
        name=f"gemv_{epilogue}" + ("_norm" if scale is not None else "") + ("_8bit" if w_scale is not None else ""),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*args)


def rows_for(n_out: int, n_in: int, dtype=None) -> int:
    """Rows per program for an [n_out, in] product (n_out: the SwiGLU kernel's gate rows); 1-byte weights (dtype)
    have a table of their own."""
    eight_bit = dtype is not None and jnp.dtype(dtype).itemsize == 1
    rows = (tables.GEMV_ROWS_8BIT if eight_bit else tables.GEMV_ROWS).get((n_out, n_in), tables.GEMV_DEFAULT_ROWS)
    return rows if n_out % rows == 0 else 1


def block_in_for(n_out: int, n_in: int, dtype, w_block: tuple[int, int] | None = None) -> int:
    """The measured table for 2-byte weights; 128 for 4-byte weights (the same 16-byte lanes hold half the
    elements); tables.GEMV_BLOCK_IN_8BIT for 1-byte weights (with block scales, w_block: a divisor or multiple of the
    blocks' columns)."""
    size = jnp.dtype(dtype).itemsize
    if size == 1:
        block_in = tables.GEMV_BLOCK_IN_8BIT.get((n_out, n_in), tables.GEMV_DEFAULT_BLOCK_IN_8BIT)
        if w_block is None or w_block[1] % block_in == 0 or block_in % w_block[1] == 0:
            return block_in
        return min(block_in, pow2_divisor(w_block[1]))
    if size != 2:
        return 128
    return tables.GEMV_BLOCK_IN.get((n_out, n_in), tables.GEMV_DEFAULT_BLOCK_IN)


def warps_for(n_out: int, n_in: int, dtype) -> int:
    """Warps a program: 1, or for 1-byte weights tables.GEMV_WARPS_8BIT's."""
    if jnp.dtype(dtype).itemsize != 1:
        return 1
    return tables.GEMV_WARPS_8BIT.get((n_out, n_in), 1)


def int8_convert_for(n_out: int, n_in: int) -> str:
    """How int8 weights become float32 for an [n_out, in] product (n_out as rows_for's):
    tables.GEMV_INT8_CONVERT_BY_SHAPE's, else tables.GEMV_INT8_CONVERT."""
    return tables.GEMV_INT8_CONVERT_BY_SHAPE.get((n_out, n_in), tables.GEMV_INT8_CONVERT)
