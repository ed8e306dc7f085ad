"""A decode layer's four GEMVs for L layers in one persistent Pallas Triton kernel (an experiment, not in the ops).

    stream_0 = x;  per layer:  q = W0 s;  a = round(W1 q) + s;  h = silu_mul(W2 a);  s' = round(W3 h) + a

(kernels_mosaic_gemv's chain: a layer's products without norms or attention). On the H200 a kernel boundary costs
~3.7 us a product in a chain of streaming kernels (bench/NOTES.md, twenty-seventh session); this kernel pays grid
barriers instead. It launches `programs` CTAs (one or two an SM, all resident: the barrier spins), and every product
is a phase: its output rows are cut into tiles of `rows` rows, and the CTAs take them either as equal contiguous
shares ("static") or one at a time from a fetch-and-add counter ("tickets": a CTA that runs ahead takes more, against
the skew that makes a barrier wait). A CTA keeps the weights of the next `prefetch` tiles loading into registers while
it sums the current one, so its loads stay in flight across tiles, and (static schedule) issues a phase's first
tiles' loads before the barrier that opens the phase; the input vector is loaded once a phase, after it.

The grid barrier between phases: every thread's stores are ordered by a CTA barrier, one acq_rel add on a counter
arrives, volatile loads poll it until it reaches (phases so far) x programs, an acquire add makes the other CTAs'
stores visible. Activations written in the kernel are read with plain loads: each (layer, product) writes rows of its
own, 128-byte aligned, that no CTA reads before the barrier after their writes, so no SM can hold a stale L1 line of
them (jax 0.11.2's Pallas Triton rejects the `.cg` modifier: its check wants ".cg", its table has "cg"). A poll
loop gives up after `max_polls` and the CTA's flag in the second output says so (a launch whose CTAs are not all
resident would otherwise hang the GPU; in interpret mode the programs run one after another, so more than one
program always times out there).

Rounding is the engine's GEMV's (fused_gemv): float32 products summed per [rows, block_k] lane tile, rounded to bf16,
then the residual added in bf16; SwiGLU as blocks.silu_mul. The sums run in another order than fused_gemv's
(block_k here), so the outputs agree to bf16's rounding, not bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas.blocks import silu_mul

f32 = jnp.float32
i32 = jnp.int32
EPILOGUES = ("none", "residual", "swiglu", "residual")   # the chain's four products, in order


@dataclasses.dataclass(frozen=True)
class Product:
    n: int      # weight rows (gate + up rows for the SwiGLU product)
    k: int      # input width
    rows: int   # output rows a tile (a power of two dividing the output rows)

    def out(self, epilogue: str) -> int:
        return self.n // 2 if epilogue == "swiglu" else self.n


def layer_products(d: int, q: int, inter: int, rows: tuple[int, int, int, int]) -> tuple[Product, ...]:
    """The chain's products for a model width d, a QKV output of q rows and an MLP width inter."""
    return (Product(q, d, rows[0]), Product(d, q, rows[1]), Product(2 * inter, d, rows[2]), Product(d, inter, rows[3]))


def check(products: tuple[Product, ...], block_k: int) -> None:
    if len(products) != 4:
        raise ValueError("persistent_gemv: a layer is four products")
    p0, p1, p2, p3 = products
    if not (p1.k == p0.n and p2.k == p1.n == p0.k and p3.k == p2.n // 2 and p3.n == p0.k):
        raise ValueError(f"persistent_gemv: the products do not chain: {products}")
    for p, ep in zip(products, EPILOGUES):
        if p.k % block_k:
            raise ValueError(f"persistent_gemv: {p} needs k a multiple of block_k {block_k}")
        if p.out(ep) % p.rows or p.rows & (p.rows - 1):
            raise ValueError(f"persistent_gemv: {p} needs rows a power of two dividing its {p.out(ep)} outputs")


def _kernel(s_in, w0, w1, w2, w3, ctr_in, q_ref, a_ref, h_ref, s_ref, ctr_ref, err_ref, *, products, layers,
            programs, block_k, schedule, barriers, prefetch, x_in_registers, max_polls, interpret):
    del s_in, ctr_in   # aliased to s_ref and ctr_ref
    pid = pl.program_id(0)
    ks = jnp.arange(block_k, dtype=i32)
    # (index and increment operands as values traced here: literals made inside a loop body become constants
    # that interpret mode's discharge of the while loop rejects)
    zero, one = pid * 0, pid * 0 + 1

    def cta_barrier():
        if not interpret:   # (interpret mode runs a program as one thread: nothing to order)
            plgpu.debug_barrier()

    def barrier(phase, err):
        """Grid barrier number phase + 1 (counter slot 0 counts arrivals over the whole launch)."""
        if not barriers:
            return err
        target = (phase + 1) * programs
        cta_barrier()
        plgpu.atomic_add(ctr_ref, (zero,), one)

        def cond(c):
            return (c[0] < target) & (c[1] < max_polls)

        def body(c):
            return plgpu.load(ctr_ref.at[zero], volatile=True), c[1] + 1

        seen, _ = jax.lax.while_loop(cond, body, (plgpu.load(ctr_ref.at[zero], volatile=True), zero))
        plgpu.atomic_add(ctr_ref, (zero,), zero)   # acquire: the arrivals' stores are visible after it
        cta_barrier()
        return err | (seen < target).astype(i32)

    def product(l, phase, j, w_ref, in_ref, in_row, out_ref, out_row, res_ref, res_row, err):
        """Phase `phase`: meet the CTAs that wrote this product's input (barrier `phase`), then stream its tiles. The
        static schedule issues its first tiles' weight loads before the meeting (weights do not wait on anyone),
        so HBM stays busy while the CTAs gather."""
        p, ep = products[j], EPILOGUES[j]
        R, chunks, half = p.rows, p.k // block_k, p.n // 2
        tiles = p.out(ep) // R
        r = jnp.arange(R, dtype=i32)

        def load_tile(t, ok):
            rows = t * R + r
            mask = jnp.broadcast_to(ok, (R, block_k))
            sets = [rows, rows + half] if ep == "swiglu" else [rows]
            return tuple(plgpu.load(w_ref.at[l, rs[:, None], c * block_k + ks[None, :]], mask=mask, other=0,
                                    eviction_policy="evict_first")
                         for rs in sets for c in range(chunks))

        def finish(t, tile, xs):
            rows = t * R + r
            sums = []
            for s in range(len(tile) // chunks):
                acc = jnp.zeros((R, block_k), f32)
                for c in range(chunks):
                    xc = xs[c] if x_in_registers else load_chunk(c)
                    acc = acc + tile[s * chunks + c].astype(f32) * xc[None, :]
                sums.append(jnp.sum(acc, axis=1).astype(out_ref.dtype))
            if ep == "swiglu":
                y = silu_mul(sums[0], sums[1])
            elif ep == "residual":
                y = sums[0] + plgpu.load(res_ref.at[res_row, rows])
            else:
                y = sums[0]
            plgpu.store(out_ref.at[out_row, rows], y)

        def load_chunk(c):
            return plgpu.load(in_ref.at[in_row, pl.ds(c * block_k, block_k)]).astype(f32)

        def load_input():
            """The phase's input vector, held in registers for the phase (after the meeting), or None: then every
            tile reloads its chunks (L1 hits after the first), leaving the registers to weights in flight."""
            return [load_chunk(c) for c in range(chunks)] if x_in_registers else None

        if schedule == "static":
            start = pid * tiles // programs
            stop = (pid + 1) * tiles // programs
            if prefetch:
                ahead = tuple(load_tile(start + i, start + i < stop) for i in range(prefetch))
                err = barrier(phase, err)
                xs = load_input()

                def body(t, ahead):
                    nxt = load_tile(t + prefetch, t + prefetch < stop)
                    finish(t, ahead[0], xs)
                    return (*ahead[1:], nxt)

                jax.lax.fori_loop(start, stop, body, ahead)
            else:
                err = barrier(phase, err)
                xs = load_input()

                def body(t, c):
                    finish(t, load_tile(t, True), xs)
                    return c

                jax.lax.fori_loop(start, stop, body, jnp.int32(0))
        else:   # tickets: counter slot 1 + phase hands out this phase's tiles, one a tile ahead
            err = barrier(phase, err)
            xs = load_input()
            slot = (one + phase,)

            def ticket():
                return plgpu.atomic_add(ctr_ref, slot, one)

            def cond(c):
                return c[0] < tiles

            def body(c):
                t, tile, t_next = c
                ok = t_next < tiles
                nxt = load_tile(t_next, ok)                         # in flight while the next ticket comes
                t_after = jnp.where(ok, ticket(), tiles)
                finish(t, tile, xs)
                return t_next, nxt, t_after

            t0 = ticket()
            tile0 = load_tile(t0, t0 < tiles)
            t1 = jnp.where(t0 < tiles, ticket(), tiles)
            jax.lax.while_loop(cond, body, (t0, tile0, t1))
        return err

    def layer(l, err):
        # barrier number b waits for the writers of phase b's input (b = 0: the launch's start, a formality)
        base = 4 * l
        err = product(l, base, 0, w0, s_ref, l, q_ref, l, None, None, err)
        err = product(l, base + 1, 1, w1, q_ref, l, a_ref, l, s_ref, l, err)
        err = product(l, base + 2, 2, w2, a_ref, l, h_ref, l, None, None, err)
        return product(l, base + 3, 3, w3, h_ref, l, s_ref, l + 1, a_ref, l, err)

    err = jax.lax.fori_loop(0, layers, layer, jnp.int32(0))
    plgpu.store(err_ref.at[pid], err)


@functools.partial(jax.jit, static_argnames=("products", "programs", "num_warps", "block_k", "schedule", "barriers",
                                             "prefetch", "x_in_registers", "num_stages", "max_polls", "interpret"))
def persistent_chain(x: jax.Array, weights: tuple[jax.Array, ...], *, products: tuple[Product, ...],
                     programs: int = 132, num_warps: int = 8, block_k: int = 512, schedule: str = "static",
                     barriers: bool = True, prefetch: int = 1, x_in_registers: bool = True, num_stages: int = 1,
                     max_polls: int = 1 << 20,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [d] bf16; weights (W0 [L, q, d], W1 [L, d, q], W2 [L, 2I, d], W3 [L, d, I]) -> (the stream after L layers
    [d], each program's timed-out flag [programs] int32: nonzero means the barriers did not hold and the output is
    wrong). prefetch: tiles whose weights load ahead of the one being summed (0: none); x_in_registers=False reloads
    the input's chunks every tile; num_stages > 1 asks Triton's software pipeliner to stage the tile loop's loads
    through shared memory (official Triton 3.6 does so for loads that feed no dot, bench/NOTES.md; use prefetch=0).
    barriers=False gives wrong sums on purpose: the loop's streaming time without meetings."""
    check(products, block_k)
    if schedule not in ("static", "tickets"):
        raise ValueError(f"persistent_gemv: schedule {schedule!r}")
    L = weights[0].shape[0]
    for w, p in zip(weights, products):
        if w.shape != (L, p.n, p.k):
            raise ValueError(f"persistent_gemv: weight {w.shape} against {p}")
    d, dt = x.shape[0], x.dtype
    s = jnp.zeros((L + 1, d), dt).at[0].set(x)
    ctr = jnp.zeros((1 + 4 * L,), i32)
    kernel = functools.partial(_kernel, products=products, layers=L, programs=programs, block_k=block_k,
                               schedule=schedule, barriers=barriers, prefetch=prefetch,
                               x_in_registers=x_in_registers, max_polls=max_polls,
                               interpret=interpret)
    out_shape = (jax.ShapeDtypeStruct((L, products[0].n), dt), jax.ShapeDtypeStruct((L, d), dt),
                 jax.ShapeDtypeStruct((L, products[3].k), dt), jax.ShapeDtypeStruct((L + 1, d), dt),
                 jax.ShapeDtypeStruct(ctr.shape, i32), jax.ShapeDtypeStruct((programs,), i32))
    *_, s_out, _, err = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(programs,), interpret=interpret, name="persistent_gemv_chain",
        input_output_aliases={0: 3, 5: 4},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )(s, *weights, ctr)
    return s_out[L], err


def reference_chain(x: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
    """The twin: float32 products rounded to x's dtype, the residuals added and SwiGLU taken as the kernel does."""
    dt = x.dtype

    def mv(w, v):
        return jnp.dot(w.astype(f32), v.astype(f32), precision=jax.lax.Precision.HIGHEST).astype(dt)

    s = x
    for l in range(weights[0].shape[0]):
        w0, w1, w2, w3 = (w[l] for w in weights)
        q = mv(w0, s)
        a = mv(w1, q) + s
        g = mv(w2, a)
        h = silu_mul(g[: g.shape[0] // 2], g[g.shape[0] // 2:])
        s = mv(w3, h) + a
    return s
