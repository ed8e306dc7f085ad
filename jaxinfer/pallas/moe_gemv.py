"""Batch-1 decode of a mixture of experts: GEMVs over the top-k experts' matrices only, the routing in the kernels.

At one token the experts' products are GEMVs: of Qwen3-30B-A3B's 128 experts a layer the token reads 8. Two
kernels make the whole block after the router's product (its logits [1, E], a GEMV of their own):

    h[j]  = silu(n @ G[e_j].T) * (n @ U[e_j].T)              routed_gemv(..., epilogue="swiglu")   [top_k, I]
    out   = residual + sum_j p_j * round(h[j] @ D[e_j].T)     routed_gemv(..., epilogue="combine")  [1, D]

n is x, or rms_norm(x) with `scale`: the norm as the GEMV's prologue (pallas/fused_gemv.py's: the sum of squares from
the same x tiles, applied to the sums). Every program reads the E logits (a few hundred bytes) and routes as
reference.route does (softmax in float32, the top_k probabilities, ties to the lower index, optionally
renormalised): no top-k, sort or gather kernel between them. The gate/up kernel can write the routes it computed
(emit_routes) for the combine to take as operands (routes), so that only one of the two routes. Weights stay in the
stacked [L, E, N, K] array, read in place at `layer` and the chosen expert. As pallas/fused_gemv.py: one warp a
program, `rows` output rows each a [block_in] vector of consecutive weights, float32 sums, rounded where the
reference rounds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import tables
from jaxinfer.pallas.blocks import layer_operands, pow2_at_least, pow2_divisor, row_tiles, scale_shape, silu_mul
from jaxinfer.pallas.fused_gemv import weights_to_f32

f32 = jnp.float32
i32 = jnp.int32
NEG = -1e30   # a masked logit (finite: exp gives 0 without inf arithmetic)
EPILOGUES = ("swiglu", "combine")
UNROLL_TILES = 8   # depths of at most this many block_in tiles run as straight-line code, deeper ones as a loop


def _route(logits_ref, E: int, top_k: int, renormalize: bool):
    """(experts, weights): top_k int32 and float32 scalars, as reference.route computes them."""
    EP = pow2_at_least(E, 16)
    lanes = jnp.arange(EP, dtype=i32)
    valid = lanes < E
    logits = plgpu.load(logits_ref.at[i32(0), jnp.minimum(lanes, E - 1)], mask=valid, other=0).astype(f32)
    logits = jnp.where(valid, logits, NEG)
    p = jnp.exp(logits - jnp.max(logits))
    p = jnp.where(valid, p, 0.0)
    p = p / jnp.sum(p)
    experts, weights = [], []
    for _ in range(top_k):
        best = jnp.max(p)
        idx = jnp.min(jnp.where(valid & (p == best), lanes, EP))
        experts.append(idx)
        weights.append(best)
        p = jnp.where(lanes == idx, -1.0, p)   # probabilities are >= 0: taken out of the next rounds
    if renormalize:
        total = weights[0]
        for w in weights[1:]:
            total = total + w
        weights = [w / total for w in weights]
    return experts, weights


def _row_sums(x_ref, x_row, w_ref, layer, expert, w_rows, n_in, block_in, scale_ref=None, vlayer=None, eps=0.0,
              ws_ref=None, w_block=None):
    """float32 dot products of x_ref[x_row] (with scale_ref: rms_norm(x) with scale_ref[vlayer]) with rows w_rows of
    W[layer, expert]; 8-bit W (ws_ref: its scales) converted exactly: [L, E, N] one a row, each sum times its row's
    scale; or [L, E, N / bo, K / bi] one a (bo, bi) block (w_block; block_in divides bi), each tile's products times
    its block's scale."""
    def tile(carry, idx, cmask, k0):
        accs, sumsq = carry

        def load(ref_win):
            return plgpu.load(ref_win) if cmask is None else plgpu.load(ref_win, mask=cmask, other=0)

        xt = load(x_ref.at[x_row, idx]).astype(f32)
        if scale_ref is not None:
            sumsq = sumsq + xt * xt
            xt = xt * load(scale_ref.at[vlayer, idx]).astype(f32)
        products = [weights_to_f32(load(w_ref.at[layer, expert, r, idx])) * xt for r in w_rows]
        if w_block is not None:
            bo, bi = w_block
            products = [p * ws_ref[layer, expert, r // bo, k0 // bi] for p, r in zip(products, w_rows)]
        return [a + p for a, p in zip(accs, products)], sumsq

    carry = ([jnp.zeros((block_in,), f32) for _ in w_rows], jnp.zeros((block_in,), f32))
    full = n_in // block_in
    if full <= UNROLL_TILES:   # few tiles: straight-line code, every load can be issued ahead
        for t, (idx, cmask) in enumerate(row_tiles(n_in, block_in)):
            carry = tile(carry, idx, cmask, t * block_in)
    else:   # a loop (unrolled, the tiles' loads would stay live at once: 2.5k spilled registers at Mixtral's 14,336)
        carry = jax.lax.fori_loop(0, full, lambda t, c: tuple(tile(c, pl.ds(pl.multiple_of(t * block_in, block_in),
                                                                            block_in), None, t * block_in)), carry)
        if n_in % block_in:
            cols = full * block_in + jnp.arange(block_in, dtype=i32)
            carry = tile(carry, jnp.minimum(cols, n_in - 1), cols < n_in, full * block_in)
    accs, sumsq = carry
    ys = [jnp.sum(a) for a in accs]
    if scale_ref is not None:
        inv = jax.lax.rsqrt(jnp.sum(sumsq) / n_in + eps)
        ys = [y * inv for y in ys]
    if ws_ref is not None and w_block is None:
        ys = [y * ws_ref[layer, expert, r] for y, r in zip(ys, w_rows)]
    return ys


def _kernel(layer_ref, vlayer_ref, *refs, E, top_k, renormalize, epilogue, n_in, half, rows, block_in, has_scale,
            has_residual, w_scaled, w_block, routed, emit_routes, eps):
    refs = list(refs)
    if routed:   # the routes as operands: the top_k experts (int32) and their weights (float32); the gate/up
        experts_ref, weights_ref = refs.pop(0), refs.pop(0)   # program reads its own expert only
        if epilogue == "combine":
            experts = [experts_ref[jj] for jj in range(top_k)]
            weights = [weights_ref[jj] for jj in range(top_k)]
    else:
        experts, weights = _route(refs.pop(0), E, top_k, renormalize)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    ws_ref = refs.pop(0) if w_scaled else None
    scale_ref = refs.pop(0) if has_scale else None
    res_ref = refs.pop(0) if has_residual else None
    o_ref = refs.pop(0)
    layer, vlayer = layer_ref[0], vlayer_ref[0]
    dtype = o_ref.dtype
    if emit_routes:   # one program writes the routes for the combine kernel, which then routes no more
        experts_out, weights_out = refs

        @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0))
        def _():
            for jj in range(top_k):
                experts_out[jj] = experts[jj]
                weights_out[jj] = weights[jj]
    if epilogue == "swiglu":   # program (j, r): rows r * rows.. of h[j], expert e_j
        j = pl.program_id(0)
        first = pl.program_id(1) * rows
        if routed:
            expert = experts_ref[j]
        else:
            expert = experts[0]
            for jj in range(1, top_k):
                expert = jnp.where(j == jj, experts[jj], expert)
        out_rows = [first + r for r in range(rows)]
        ys = _row_sums(x_ref, i32(0), w_ref, layer, expert, out_rows + [r + half for r in out_rows], n_in, block_in,
                       scale_ref, vlayer, eps, ws_ref, w_block)
        ys = [y.astype(dtype) for y in ys]   # the projection rounds, then SwiGLU as the reference rounds it
        for r, row in enumerate(out_rows):
            o_ref[j, row] = silu_mul(ys[r], ys[rows + r]).astype(dtype)
        return
    # combine: program r, rows r * rows.. of the output, summed over the top_k experts
    first = pl.program_id(0) * rows
    out_rows = [first + r for r in range(rows)]
    totals = [jnp.zeros((), f32) for _ in out_rows]
    for jj in range(top_k):
        ys = _row_sums(x_ref, i32(jj), w_ref, layer, experts[jj], out_rows, n_in, block_in, ws_ref=ws_ref,
                       w_block=w_block)
        totals = [t + y.astype(dtype).astype(f32) * weights[jj] for t, y in zip(totals, ys)]
    for t, row in zip(totals, out_rows):
        y = t.astype(dtype)
        if res_ref is not None:
            y = res_ref[i32(0), row] + y
        o_ref[i32(0), row] = y.astype(dtype)


def choose_config(epilogue: str, n_out: int) -> tuple[int, int]:
    """(rows a program, block_in) from tables.ROUTED_GEMV: its rows, or the most of them below that divide n_out."""
    rows, block_in = tables.ROUTED_GEMV[epilogue]
    return next(r for r in (rows, 8, 4, 2, 1) if r <= rows and n_out % r == 0), block_in


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "epilogue", "eps", "emit_routes", "w_block",
                                             "rows", "block_in", "num_warps", "interpret"))
def routed_gemv(x: jax.Array, logits: jax.Array | None, w: jax.Array, layer: jax.Array | int = 0, *, top_k: int,
                renormalize: bool, epilogue: str, residual: jax.Array | None = None, scale: jax.Array | None = None,
                eps: float = 1e-6, vector_layer: jax.Array | int | None = None,
                routes: tuple[jax.Array, jax.Array] | None = None, emit_routes: bool = False,
                w_scale: jax.Array | None = None, w_block: tuple[int, int] | None = None, rows: int | None = None,
                block_in: int | None = None,
                num_warps: int = 1,
                interpret: bool = False) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One token's mixture of experts, one product a call, routed by its router logits [1, E], or by `routes`
    (experts int32 [top_k], weights float32 [top_k], as reference.route gives them; logits then unused).
    epilogue "swiglu": x [1, K], w [L, E, 2I, K] each expert's [gate; up]: returns h [top_k, I]; with scale
    ([Ls, K] read at vector_layer, default `layer`; or [K]) x is RMS-normed first (eps). emit_routes: returns
    (h, routes), the routes it computed, for the combine to take.
    epilogue "combine": x = h [top_k, K], w [L, E, N, K]: returns [1, N], the experts' outputs rounded, weighted
    by their routing probabilities and summed in float32, rounded (+ residual [1, N], rounded again).
    8-bit w (int8, float8_e4m3fn) takes w_scale: [L, E, N] float32, one scale an output row (each row's sum times
    its scale, as reference.grouped_linear computes it), or with w_block = (bo, bi) [L, E, ceil(N / bo),
    ceil(K / bi)], one a block (each tile's products times its block's; block_in divides bi). A 3-D w (and a w_scale
    of one axis fewer) is one layer."""
    if w.ndim == 3:
        w = w[None]
        w_scale = None if w_scale is None else w_scale[None]
    want = scale_shape(w.shape, w_block) if w.dtype.itemsize == 1 else None
    if (w_scale is None) != (want is None) or (w_scale is not None and w_scale.shape != want):
        raise ValueError(f"routed_gemv: 8-bit weights take w_scale {want} (and only they); got w {w.dtype} "
                         f"{w.shape}, w_scale {None if w_scale is None else w_scale.shape}, block {w_block}")
    if w.ndim != 4 or x.ndim != 2:
        raise ValueError(f"routed_gemv: x [R, K], w [L, E, N, K]; got {x.shape}, {w.shape}")
    _, E, N, K = w.shape
    if routes is None and (logits is None or logits.shape != (1, E)):
        raise ValueError(f"routed_gemv: logits [1, {E}] (or routes) for w {w.shape}; got "
                         f"{None if logits is None else logits.shape}")
    if routes is not None and (len(routes) != 2 or routes[0].shape != (top_k,) or routes[1].shape != (top_k,)):
        raise ValueError(f"routed_gemv: routes are (experts [{top_k}], weights [{top_k}])")
    if emit_routes and (routes is not None or epilogue != "swiglu"):
        raise ValueError("routed_gemv: emit_routes goes with swiglu routing by its logits")
    if x.shape[1] != K:
        raise ValueError(f"routed_gemv: x {x.shape} does not fit w {w.shape}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"routed_gemv: unknown epilogue {epilogue!r}")
    if not 0 < top_k <= E:
        raise ValueError(f"routed_gemv: top_k {top_k} of {E} experts")
    want_rows = 1 if epilogue == "swiglu" else top_k
    if x.shape[0] != want_rows or (residual is not None and (epilogue != "combine" or residual.shape != (1, N))):
        raise ValueError(f"routed_gemv: {epilogue} takes x of {want_rows} rows (got {x.shape[0]}) and a residual "
                         f"[1, {N}] only with combine")
    if scale is not None and epilogue != "swiglu":
        raise ValueError("routed_gemv: the norm prologue (scale) goes with swiglu")
    if scale is not None and scale.ndim == 1:
        scale, vector_layer = scale[None], 0
    if epilogue == "swiglu" and N % 2:
        raise ValueError(f"routed_gemv: swiglu needs an even number of rows, got {N}")
    n_out = N // 2 if epilogue == "swiglu" else N
    rows_default, block_default = choose_config(epilogue, n_out)
    rows, block_in = rows or rows_default, block_in or block_default
    if n_out % rows:
        raise ValueError(f"routed_gemv: {rows} rows a program do not divide {n_out}")
    block_in = min(block_in, pow2_at_least(K))
    if w_block is not None:   # every tile inside one block of columns
        block_in = min(block_in, pow2_divisor(w_block[1]))
    kernel = functools.partial(_kernel, E=E, top_k=top_k, renormalize=renormalize, epilogue=epilogue, n_in=K,
                               half=N // 2, rows=rows, block_in=block_in, has_scale=scale is not None,
                               has_residual=residual is not None, w_scaled=w_scale is not None, w_block=w_block,
                               routed=routes is not None, emit_routes=emit_routes, eps=eps)
    if epilogue == "swiglu":
        grid, out_shape = (top_k, n_out // rows), jax.ShapeDtypeStruct((top_k, n_out), x.dtype)
    else:
        grid, out_shape = (n_out // rows,), jax.ShapeDtypeStruct((1, n_out), x.dtype)
    if emit_routes:
        out_shape = (out_shape, jax.ShapeDtypeStruct((top_k,), i32), jax.ShapeDtypeStruct((top_k,), f32))
    route_args = [logits] if routes is None else [routes[0].astype(i32), routes[1].astype(f32)]
    args = [*layer_operands(layer, vector_layer), *route_args, x, w] + [a for a in (w_scale, scale, residual)
                                                                        if a is not None]
    out = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, interpret=interpret, name=f"routed_gemv_{epilogue}",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
    )(*args)
    return (out[0], (out[1], out[2])) if emit_routes else out
