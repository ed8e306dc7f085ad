"""What one jitted call costs the host by the number of device arrays it takes (the engine's steps take
every layer's weights as separate arrays: ~300 for a 36-layer model).

    PYTHONPATH=. python3 bench/dispatch_args.py [--counts 1 32 320 640] [--calls 200]

For each count N: a jitted function of N small device arrays (it adds one element of each), called
`calls` times back to back without waiting; host time per call (median of 5 rounds), then per array.
Prints one table; JSON to $OUT/dispatch_args.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.table import print_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 32, 320, 640])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for n in args.counts:
        arrays = [jnp.full((4,), i, jnp.float32) for i in range(n)]
        f = jax.jit(lambda *a: sum(x[0] for x in a))
        f(*arrays).block_until_ready()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                out = f(*arrays)
            rounds.append((time.perf_counter() - t0) / args.calls)
            out.block_until_ready()
        us = 1e6 * statistics.median(rounds)
        rows.append(dict(arrays=n, us_per_call=us, us_per_array=us / n))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: host time of a jitted call by its device arrays")
    print_table(rows, [("arrays", "arrays", ""), ("us per call", "us_per_call", ".1f"),
                       ("us per array", "us_per_array", ".2f")])
    Path(args.out, "dispatch_args.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
