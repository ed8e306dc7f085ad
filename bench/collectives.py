"""What tensor parallelism's all-reduces cost, per layer, at decode shapes, under XLA's collective flags.

A decode step at tensor parallel N runs two all-reduces a layer (after o_proj and after down) of [B, D] in the
model's dtype. Here a chain of `--layers` such pairs runs inside one jitted shard_map (each reduce depends on the
last, as in the model), against the same chain with the reduce replaced by a local op: the difference over the
chain's length is what one all-reduce adds to a step. Each flag set runs in a process of its own (XLA reads its
flags once):

    default    XLA's choice (NCCL)
    one-shot   --xla_gpu_experimental_use_collective_kernels=ALL_REDUCE (XLA's Triton one-shot kernel)
    no-cmdbuf  --xla_gpu_enable_command_buffer= (command buffers off: launches one by one)

GPU:  PYTHONPATH=. python bench/collectives.py --tp 2 4 8
CPU smoke (host devices): PYTHONPATH=. python bench/collectives.py --cpu --tp 2 --batches 1 --widths 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "default": "",
    "one-shot": "--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE",
    "no-cmdbuf": "--xla_gpu_enable_command_buffer=",
}


def measure(tp: int, batches: list[int], widths: list[int], layers: int, iters: int) -> list[dict]:
    """In this process: us per all-reduce of [B, D] bf16 over tp devices, in a chain of 2 * layers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    rows = []
    for d in widths:
        for b in batches:
            def chain(x, reduce):
                def body(x):
                    for _ in range(2 * layers):   # a layer's two reduces; each feeds the next
                        x = reduce(x) * jnp.asarray(0.5, x.dtype) + x
                    return x
                return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(x)

            x = jnp.ones((b, d), jnp.bfloat16)
            times = {}
            for name, reduce in (("psum", lambda x: jax.lax.psum(x, "tp")), ("local", lambda x: x * x)):
                fn = jax.jit(lambda x, reduce=reduce: chain(x, reduce))
                jax.block_until_ready(fn(x))
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        y = fn(x)
                    jax.block_until_ready(y)
                    best = min(best, (time.perf_counter() - t0) / iters)
                times[name] = best
            per = (times["psum"] - times["local"]) / (2 * layers)
            rows.append(dict(tp=tp, batch=b, width=d, bytes=b * d * 2, chain_us=round(1e6 * times["psum"], 1),
                             local_chain_us=round(1e6 * times["local"], 1), all_reduce_us=round(1e6 * per, 2),
                             per_layer_us=round(2e6 * per, 2)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--widths", type=int, nargs="+", default=[2560, 4096])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--cpu", action="store_true", help="host devices (a smoke run; the GPU flags are left out)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.child:   # one variant, one tensor-parallel size, in this process
        measure(args.tp[0], args.batches, args.widths, args.layers, args.iters)
        return
    rows = []
    for variant in (["default"] if args.cpu else args.variants):
        for tp in args.tp:
            flags = f"--xla_force_host_platform_device_count={tp}" if args.cpu else VARIANTS[variant]
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
            if args.cpu:
                env["JAX_PLATFORMS"] = "cpu"
            cmd = [sys.executable, __file__, "--child", variant, "--tp", str(tp), "--layers", str(args.layers),
                   "--iters", str(args.iters), "--batches", *map(str, args.batches), "--widths", *map(str, args.widths)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"# {variant} tp {tp}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            for line in out.stdout.splitlines():
                if line.startswith("{"):
                    row = {"variant": variant, **json.loads(line)}
                    rows.append(row)
                    print(f"# {json.dumps(row)}", flush=True)
    print(f"\n| variant | TP | batch | width | bytes | all-reduce us | per layer us |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['tp']} | {r['batch']} | {r['width']} | {r['bytes']} | {r['all_reduce_us']} | "
              f"{r['per_layer_us']} |")
    Path(args.out, "collectives.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
