"""Does a decode GEMV run faster when its weights are already in the L2 (60 MB on the H200)?

    PYTHONPATH=. python3 bench/kernels_l2_prefetch.py [--interpret]

The question behind it (issue 3): the small projections of a batch-1 decode step (QKV 31 MB,
o_proj 21 MB) reach only ~60% of HBM bandwidth, each paying a few microseconds of ramp and tail,
while decode attention before o_proj is latency-bound (4 MB of KV in ~7 us). If the o_proj weights
could be pulled into L2 while attention runs, o_proj would read them from L2. This measures the
two ends of that idea, with no fusion yet: per call, in one jit over n distinct weight matrices
(together several times the L2):
- gemv cold: the fused GEMV of the engine (pallas/fused_gemv.py) reading from HBM;
- touch: a kernel that only reads the weights (evict_last) and writes one float per program;
- touch + gemv: the two back to back on the same weights; gemv warm = (touch + gemv) - touch.
Prints one table; JSON to $OUT/l2_prefetch.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench.ceilings import hbm_read_ceiling
from bench.kernels.kernel_timing import rel_err
from jaxinfer.pallas.fused_gemv import block_in_for, fused_gemv

f32 = jnp.float32
ROUNDS = 8


def _touch_kernel(salt_ref, w_ref, o_ref, *, rows, block_in, n_tiles, policy):
    r0 = pl.program_id(0) * rows
    acc = jnp.zeros((rows, block_in), f32)
    for i in range(n_tiles):
        acc += plgpu.load(w_ref.at[pl.ds(r0, rows), pl.ds(i * block_in, block_in)], **policy).astype(f32)
    o_ref[pl.program_id(0)] = jnp.sum(acc) + salt_ref[0]


def touch(w: jax.Array, salt: float = 0.0, rows: int = 4, block_in: int = 512, policy: str = "evict_last",
          interpret: bool = False) -> jax.Array:
    """Read every weight once (into L2 with evict_last); one float per program so nothing is dropped
    (`salt` is added to it, so that calls on the same weights are not merged)."""
    n_out, n_in = w.shape
    assert n_out % rows == 0 and n_in % block_in == 0
    kern = functools.partial(_touch_kernel, rows=rows, block_in=block_in, n_tiles=n_in // block_in,
                             policy={} if policy == "plain" else dict(eviction_policy=policy))
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((n_out // rows,), f32), grid=(n_out // rows,),
                          interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(
                              jnp.full((1,), salt, f32), w)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true", help="CPU dry run on small shapes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = [(64, 512, 2)] if args.interpret else [(2560, 4096, 12), (6144, 2560, 8), (2560, 9728, 6)]
    ceiling = None if args.interpret else hbm_read_ceiling()
    rows = []
    for n_out, n_in, n in shapes:
        keys = jax.random.split(jax.random.PRNGKey(n_out + n_in), n + 1)
        ws = [jax.random.normal(k, (1, n_out, n_in), jnp.bfloat16) * (n_in ** -0.5) for k in keys[:n]]
        x = jax.random.normal(keys[-1], (1, n_in), jnp.bfloat16)
        res = jax.random.normal(keys[-1], (1, n_out), jnp.bfloat16)
        gemv = functools.partial(fused_gemv, layer=0, residual=res, epilogue="residual",
                                 block_in=block_in_for(n_out, n_in, jnp.bfloat16), interpret=args.interpret)
        t_pol = functools.partial(touch, interpret=args.interpret)

        R = 1 if args.interpret else ROUNDS   # rounds over the n matrices per call: device time >> dispatch
        variants = {
            "gemv cold": lambda ws: [gemv(x + r, w) for r in range(R) for w in ws],
            "touch": lambda ws: [t_pol(w[0], r) for r in range(R) for w in ws],
            "touch+gemv": lambda ws: [(t_pol(w[0], r), gemv(x + r, w)) for r in range(R) for w in ws],
            "gemv twice": lambda ws: [(gemv(x + r, w), gemv(x + r + 1, w)) for r in range(R) for w in ws],
        }
        times = {}
        for name, fn in variants.items():
            f = jax.jit(fn).lower(ws).compile()
            out = f(ws)
            jax.block_until_ready(out)
            calls = 2 if args.interpret else 20
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = f(ws)
                jax.block_until_ready(out)
                best = min(best, (time.perf_counter() - t0) / (calls * n * R))
            times[name] = best * 1e6
            if name == "gemv cold":
                ref = (x.astype(f32) @ ws[0][0].astype(f32).T + res.astype(f32))
                err = rel_err(out[0], ref)
        mb = n_out * n_in * 2 / 1e6
        row = dict(shape=f"{n_out}x{n_in}", mb=mb, err=err, **{k: round(v, 2) for k, v in times.items()})
        row["gemv warm (touch+gemv - touch)"] = round(times["touch+gemv"] - times["touch"], 2)
        row["second gemv (twice - cold)"] = round(times["gemv twice"] - times["gemv cold"], 2)
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
    if ceiling:
        print(f"\nHBM read ceiling {ceiling / 1e12:.2f} TB/s")
    print("| shape | MB | gemv cold us | touch us | touch+gemv us | gemv warm us | second gemv us | cold at ceiling us |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ideal = r["mb"] * 1e6 / ceiling * 1e6 if ceiling else float("nan")
        print(f"| {r['shape']} | {r['mb']:.1f} | {r['gemv cold']:.2f} | {r['touch']:.2f} | {r['touch+gemv']:.2f} | "
              f"{r['gemv warm (touch+gemv - touch)']:.2f} | {r['second gemv (twice - cold)']:.2f} | {ideal:.2f} |")
    Path(args.out, "l2_prefetch.json").write_text(json.dumps(dict(ceiling=ceiling, rows=rows), indent=1))


if __name__ == "__main__":
    main()
