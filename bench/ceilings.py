"""The ceilings every benchmark reports against, measured in the same run as the thing compared.

    from bench.ceilings import hbm_read_ceiling, dense_gemm_rate   (run with PYTHONPATH=.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def hbm_read_ceiling(gib: float = 4, calls: int = 20) -> float:
    """HBM read bandwidth in bytes/s: best of 3 timings of `jnp.sum` over `gib` GiB of bf16."""
    n = int(gib * 2**30) // 2
    x = jax.random.uniform(jax.random.PRNGKey(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    f(x).block_until_ready()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(x)
        r.block_until_ready()
        best.append((time.perf_counter() - t0) / calls)
    del x
    return 2 * n / min(best)


def dense_gemm_rate(n: int = 8192, calls: int = 10) -> float:
    """Dense bf16 GEMM rate in FLOP/s: best of 3 timings of XLA's n x n x n product."""
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = f(a, b)
        r.block_until_ready()
        best.append((time.perf_counter() - t0) / calls)
    return 2 * n**3 / min(best)
