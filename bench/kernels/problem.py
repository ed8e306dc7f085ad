"""Timing many independent products of one weight shape (each reading its weights from HBM), for the GEMM sweeps:
a Problem of n (x, w) pairs, compiled in parallel and timed one at a time."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from bench.kernels.kernel_timing import rel_err

TOL = 1e-2   # relative error a timed product may have against the float32 one


@dataclasses.dataclass
class Problem:
    n_out: int
    n_in: int
    T: int
    xs: tuple
    ws: tuple
    ref: list  # float32 products for (xs[0], ws[0]) and (xs[-1], ws[-1])

    @property
    def wbytes(self):
        return self.n_out * self.n_in * 2

    def kernels_per_call(self):
        return len(self.ws)


def make_problem(n_out, n_in, T, seed, ws=None):
    """n distinct (x, w) pairs: no operand shared (XLA's dot merger would fuse products that share
    one) and n x w bytes >= 900 MB (>= 15x the L2), so each product reads its weights from HBM."""
    wbytes = n_out * n_in * 2
    n = int(min(64, max(2, math.ceil(900e6 / wbytes))))
    if INTERPRET:
        n = 2
    kw, kx = jax.random.split(jax.random.PRNGKey(seed))
    scale = 1.0 / math.sqrt(n_in)
    if ws is None:
        ws = tuple(jax.random.normal(k, (n_out, n_in), jnp.bfloat16) * jnp.bfloat16(scale)
                   for k in jax.random.split(kw, n))
    xs = tuple(jax.random.normal(k, (T, n_in), jnp.bfloat16) for k in jax.random.split(kx, n))
    with jax.default_matmul_precision("highest"):
        f32 = jnp.float32
        ref = [jnp.dot(xs[0].astype(f32), ws[0].astype(f32).T),
               jnp.dot(xs[-1].astype(f32), ws[-1].astype(f32).T)]
    jax.block_until_ready((ws, xs, ref))
    return Problem(n_out, n_in, T, xs, ws, ref)


def build(fn, p: Problem):
    """AOT-compile one jit running fn over every (x, w) pair; returns the compiled callable."""
    def many(xs, ws):
        return [fn(x, w) for x, w in zip(xs, ws)]
    return jax.jit(many).lower(p.xs, p.ws).compile()


def time_compiled(compiled, p: Problem, target_s=0.02):
    out = compiled(p.xs, p.ws)
    jax.block_until_ready(out)
    err = max(rel_err(out[0], p.ref[0]), rel_err(out[-1], p.ref[1]))
    k = p.kernels_per_call()
    est = max(k * p.wbytes / 4e12, 20e-6)
    calls = int(min(200, max(3, target_s / est)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = compiled(p.xs, p.ws)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (calls * k))
    return best, err


INTERPRET = False  # --interpret: a CPU dry run on small shapes




def compile_then_time(p: Problem, fns: dict, pool, deadline) -> dict:
    """Compile every fn (key -> fn(x, w)) in parallel (XLA/Triton compiles release the GIL), then time
    them one at a time with the pool idle: a tracing thread holding the GIL would stall dispatch and
    inflate the times. Returns key -> {us, tbps, err, ok} or {ok: False, error}."""
    futs = {k: pool.submit(build, fn, p) for k, fn in fns.items()}
    cf.wait(list(futs.values()))
    out = {}
    for k, fut in futs.items():
        try:
            compiled = fut.result()
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is a result too
            out[k] = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if time.time() > deadline:
            out[k] = dict(ok=False, error="skipped: out of time budget")
            continue
        t, err = time_compiled(compiled, p)
        out[k] = dict(us=t * 1e6, tbps=p.wbytes / t / 1e12, err=err, ok=err < TOL)
    return out
