"""What the kernel benchmarks (bench/kernels_*.py) share: logging, the error against a reference,
and timing an AOT-compiled chain of n dependent calls of one op."""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def rel_err(y, ref) -> float:
    """||y - ref|| / ||ref|| in float64 (inf when y is not finite)."""
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref).astype(jnp.float32), np.float64)
    if not np.all(np.isfinite(y)):
        return float("inf")
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def best_ms_per_call(f, args: tuple, calls: int, repeats: int = 3, target_s: float | None = None):
    """(f(*args)'s outputs, best of `repeats` timed runs in ms per call) for a jitted f that runs an op on
    `calls` inputs in a row (device time >> dispatch); the first, untimed run compiles. target_s: each timed
    run calls f back to back for about that long (runs of ~1 ms leave the GPU at idle clocks: a GEMV so timed
    measured 4x its sweep's time)."""
    outs = jax.block_until_ready(f(*args))
    n = 1
    if target_s is not None:
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        n = max(3, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            r = f(*args)
        jax.block_until_ready(r)
        best = min(best, (time.perf_counter() - t0) / (n * calls))
    return outs, 1e3 * best


def build_chain(op, args: tuple, n: int, layers: int):
    """AOT-compile a jit that chains n calls of op(q, *rest, layer) (q <- output), the layer index
    walking over `layers` layers; it returns (last output, first output)."""

    def chain(q, *rest):
        first = None
        for i in range(n):
            q = op(q, *rest, jnp.int32(i % layers))
            first = q if first is None else first
        return q, first

    return jax.jit(chain).lower(*args).compile()


def time_chain(compiled, args: tuple, n: int, target_s: float, max_calls: int):
    """Best of 3 of (seconds per op call); and the first call's output, for checking."""
    out = compiled(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    est = time.perf_counter() - t0
    calls = int(min(max_calls, max(2, target_s / max(est, 1e-6))))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = compiled(*args)
        jax.block_until_ready(r)
        best = min(best, (time.perf_counter() - t0) / (calls * n))
    return best, out[1]


def add_sweep_args(ap, budget: float) -> None:
    """The options the attention kernel benches share: a config sweep, the table's timings, threads."""
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-table", action="store_true", help="skip the table's timings (sweep only)")
    ap.add_argument("--budget", type=float, default=budget, help="seconds for the sweep")
    ap.add_argument("--threads", type=int, default=min(14, os.cpu_count() or 4))
    ap.add_argument("--interpret", action="store_true", help="CPU dry run (tiny shapes)")


def sweep_then_table(args, results: dict, sweep, table_mode, t_start: float) -> None:
    """Compile on a thread pool: the sweep (if asked) within its budget, then the table's configs."""
    pool = cf.ThreadPoolExecutor(args.threads)
    if args.sweep:
        sweep(results, pool, t_start + args.budget, t_start)
    if not args.no_table:
        table_mode(results, pool, t_start)
    pool.shutdown(wait=False, cancel_futures=True)


def sweep_and_table_between_ceilings(args, sweep, table_mode, ceiling, key: str, unit: float, label: str):
    """Log the device; measure `ceiling()` (bytes/s or FLOP/s) before and after the sweep and the
    table, so that drift shows; returns (results, before, after, t_start), results[key] holding both
    in `unit`s."""
    t_start = time.time()
    dev = jax.devices()[0]
    log(f"device {dev.device_kind}, jax {jax.__version__}, {datetime.datetime.now().isoformat()}")
    before = ceiling()
    log(f"{label} {before / unit:.3f}")
    results = {"device": dev.device_kind, "jax": jax.__version__, "argv": sys.argv[1:],
               "date": datetime.datetime.now().isoformat(), "rows": []}
    sweep_then_table(args, results, sweep, table_mode, t_start)
    after = ceiling()
    results[key] = [before / unit, after / unit]
    return results, before, after, t_start


def save_results(results: dict, name: str) -> None:
    """results as JSON into $OUT/name, when $OUT is set (the GPU machine's output folder)."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, name), "w") as f:
            json.dump(results, f, indent=1)
