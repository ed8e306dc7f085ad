"""A batch-1 decode MLP block as one persistent Pallas Triton kernel, with a grid barrier between its phases.

    out = residual + down( silu(gate) * up ),   gate, up = rms_norm(x) @ W_gate_up[layer].T

An experiment for issue 3 (bench/NOTES.md, fifteenth session), not used by the engine. The engine runs this as
two kernels (fused_gemv's SwiGLU, then its residual GEMV); each kernel loses 2-4 us to its own ramp and tail.
Here P programs (all resident at once) first compute the SwiGLU rows p, p + P, ... into h, then meet at a grid
barrier, then compute the down rows p, p + P, ... from h. Whether a barrier costs less than a kernel boundary
is the question `bench/kernels_fused_gemv.py` answers.

Each row is summed exactly as fused_gemv's one-row program sums it (the same [block_in] vectors in the same
order, the norm's sum of squares over the same tiles), so the outputs equal the two kernels' bit for bit.

The barrier: after its stores a program synchronizes its threads (bar.sync), then adds 1 to a counter with an
acquire-release atomic at GPU scope, then spins (volatile loads) until the counter reaches the next multiple
of P, then takes an acquire atomic before reading h (volatile loads: from L2, never L1). The counter is never reset: every call adds
exactly P, so with P a power of two the multiples survive int32 wrap-around. It is state: the caller threads it
through its calls (input_output_aliases), zero at first. P must not exceed the programs the GPU holds at once
(a program that is not resident never arrives: the others spin forever).

Interpret mode runs programs one after another, so its tests use one program (the barrier then passes at once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas.blocks import is_pow2, row_tiles, silu_mul

f32 = jnp.float32
i32 = jnp.int32


def _row_dot(load_w, load_x, n_in, block_in):
    """sum(w * x) over a row in [block_in] tiles, as fused_gemv sums it."""
    acc = jnp.zeros((block_in,), f32)
    for idx, mask in row_tiles(n_in, block_in):
        acc = acc + load_w(idx, mask).astype(f32) * load_x(idx, mask)
    return jnp.sum(acc)


def _kernel(layer_ref, x_ref, wgu_ref, scale_ref, wd_ref, res_ref, cnt_in_ref, h_ref, o_ref, cnt_ref, *, D, I, P,
            block_up, block_down, eps, interpret):
    del cnt_in_ref   # aliased to cnt_ref
    p = pl.program_id(0)
    layer = layer_ref[0]
    dtype = o_ref.dtype

    def load(ref_win, mask, **kw):
        return plgpu.load(ref_win, mask=mask, other=0 if mask is not None else None, **kw)

    # the norm's factor: the sum of squares over the same tiles fused_gemv accumulates it in
    sumsq = jnp.zeros((block_up,), f32)
    for idx, mask in row_tiles(D, block_up):
        xt = load(x_ref.at[i32(0), idx], mask).astype(f32)
        sumsq = sumsq + xt * xt
    inv = jax.lax.rsqrt(jnp.sum(sumsq) / D + eps)

    def x_scaled(idx, mask):
        return load(x_ref.at[i32(0), idx], mask).astype(f32) * load(scale_ref.at[layer, idx], mask).astype(f32)

    # phase 1: h[j] = silu(gate_j) * up_j for j = p, p + P, ...
    def up_row(k, carry):
        j = jnp.minimum(p + k * P, I - 1)   # a program past the end recomputes row I - 1 and does not store it
        gate = _row_dot(lambda idx, m: load(wgu_ref.at[layer, j, idx], m), x_scaled, D, block_up) * inv
        up = _row_dot(lambda idx, m: load(wgu_ref.at[layer, j + I, idx], m), x_scaled, D, block_up) * inv
        h = silu_mul(gate.astype(dtype), up.astype(dtype))
        plgpu.store(h_ref.at[i32(0), pl.ds(j, 1)], h[None].astype(dtype), mask=(p + k * P < I)[None])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(I, P), up_row, 0)

    # the grid barrier (interpret mode has no bar.sync, nor a need for it: one program, one thread)
    if not interpret:
        plgpu.debug_barrier()
    old = plgpu.atomic_add(cnt_ref, (i32(0),), i32(1))
    target = (old | (P - 1)) + 1
    jax.lax.while_loop(lambda c: c - target < 0, lambda _: plgpu.load(cnt_ref.at[i32(0)], volatile=True), old + 1)
    plgpu.atomic_add(cnt_ref, (i32(0),), i32(0))   # acquire: the other programs' h stores are visible after it
    if not interpret:
        plgpu.debug_barrier()

    # phase 2: out[r] = residual[r] + down_r . h for r = p, p + P, ...
    # h from L2 (volatile: never a stale L1 line; jax 0.11.2's Pallas rejects every cache modifier string)
    cache = {} if interpret else {"volatile": True}

    def down_row(k, carry):
        r = jnp.minimum(p + k * P, D - 1)
        y = _row_dot(lambda idx, m: load(wd_ref.at[layer, r, idx], m),
                     lambda idx, m: load(h_ref.at[i32(0), idx], m, **cache).astype(f32), I, block_down)
        out = y.astype(dtype) + plgpu.load(res_ref.at[i32(0), pl.ds(r, 1)])[0]
        plgpu.store(o_ref.at[i32(0), pl.ds(r, 1)], out[None].astype(dtype), mask=(p + k * P < D)[None])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(D, P), down_row, 0)


@functools.partial(jax.jit, static_argnames=("eps", "programs", "block_up", "block_down", "interpret"),
                   donate_argnames=("counter",))
def mlp_block(x: jax.Array, w_gate_up: jax.Array, scale: jax.Array, w_down: jax.Array, residual: jax.Array,
              counter: jax.Array, layer: jax.Array | int = 0, *, eps: float = 1e-6, programs: int = 512,
              block_up: int = 512, block_down: int = 128, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x, residual [1, D]; w_gate_up [L, 2I, D] (gate rows, then up); scale [L, D]; w_down [L, D, I], all read at
    `layer`; counter int32 [1] (state: zeros at first, then each call's returned counter). Returns (out [1, D],
    counter). `programs` a power of two, at most what the GPU keeps resident (interpret mode: 1)."""
    if x.shape[0] != 1 or residual.shape != x.shape:
        raise ValueError(f"mlp_block: one token: x {x.shape}, residual {residual.shape}")
    L, two_i, D = w_gate_up.shape
    I = two_i // 2
    if w_down.shape != (L, D, I) or scale.shape != (L, D) or x.shape[1] != D:
        raise ValueError(f"mlp_block: w_gate_up {w_gate_up.shape}, w_down {w_down.shape}, scale {scale.shape}, x {x.shape}")
    if not is_pow2(programs) or (interpret and programs != 1):
        raise ValueError(f"mlp_block: programs={programs}: a power of two (1 in interpret mode: programs run in turn)")
    kernel = functools.partial(_kernel, D=D, I=I, P=programs, block_up=block_up, block_down=block_down, eps=eps,
                               interpret=interpret)
    h, out, counter = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((1, I), x.dtype), jax.ShapeDtypeStruct((1, D), x.dtype),
                   jax.ShapeDtypeStruct(counter.shape, jnp.int32)),
        grid=(programs,),
        input_output_aliases={6: 2},
        interpret=interpret,
        name="mlp_block_persistent",
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w_gate_up, scale, w_down, residual, counter)
    del h
    return out, counter
