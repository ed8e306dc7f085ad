"""Top-k logprobs over the vocabulary: XLA's top_k against sampling.top_k_by_blocks.

    PYTHONPATH=. python3 bench/kernels/top_k.py [--vocab 151936] [--rows 1 8 64 256] [--k 20]

Each jit runs the op on `calls` different inputs in a row (device time >> dispatch); best of 3, ms
per call. The answers are checked equal first. JSON to $OUT/top_k.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import numpy as np

from bench.kernels.kernel_timing import best_ms_per_call
from bench.table import print_table
from jaxinfer.sampling.sample import top_k_by_blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    ops = {"lax.top_k": lambda x: jax.lax.top_k(x, args.k), "top_k_by_blocks": lambda x: top_k_by_blocks(x, args.k)}
    rows = []
    for B in args.rows:
        xs = [jax.random.normal(jax.random.PRNGKey(i), (B, args.vocab)) for i in range(args.calls)]
        row = dict(rows=B)
        outs = {}
        for name, op in ops.items():
            f = jax.jit(lambda xs, op=op: [op(x) for x in xs])
            outs[name], row[name] = best_ms_per_call(f, (xs,), args.calls)
        row["equal"] = all(np.array_equal(a[1], b[1]) for a, b in zip(outs["lax.top_k"], outs["top_k_by_blocks"]))
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
    print(f"\n{jax.devices()[0].device_kind}, vocab {args.vocab}, k {args.k}")
    print_table(rows, [("rows", "rows", ""), ("lax.top_k ms", "lax.top_k", ".3f"),
                       ("top_k_by_blocks ms", "top_k_by_blocks", ".3f"), ("ids equal", "equal", "")])
    Path(args.out, "top_k.json").write_text(json.dumps(rows, indent=1))
    if not all(r["equal"] for r in rows):
        raise SystemExit("top_k_by_blocks disagreed with lax.top_k")


if __name__ == "__main__":
    main()
