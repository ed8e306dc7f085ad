"""How long does the host spend launching one decode dispatch, and on what does it depend?

    PYTHONPATH=. python3 bench/launch_cost.py [--shape qwen3-4b] [--steps 1 2 4 8]

On the H200 a greedy batch-1 dispatch of 8 or 16 decode steps took ~1 step (2.7 ms) of host time to
launch on an idle device (bench/decode_dispatch.py), which a server that waits for each dispatch
before launching the next exposes once per dispatch. For each number of steps per dispatch (one
engine's weights and cache, a jitted decode_steps per count) this prints: the host time of a launch
on an idle device, the host time of a launch chained behind a running dispatch, and the dispatch's
device time (launch to ready), best of 5.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import jax

from bench.table import print_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--steps", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxinfer.engine.engine import Engine
    from bench.random_model import bench_model
    from jaxinfer.runner.model_runner import DecodeBatch, decode_steps
    from jaxinfer.sampling.sample import SamplingArrays

    model_dir = bench_model(args.models, args.shape)
    engine = Engine(str(model_dir), dtype=args.dtype, ops=args.ops, max_num_seqs=1, max_model_len=256,
                    max_num_batched_tokens=64, token_buckets=[64], decode_steps=1, progress=False,
                    skip_tokenizer_init=True, max_logprobs=0)
    r = engine.runner
    unroll = engine.config.unroll_layers if engine.config.unroll_layers is not None else False
    rows = []
    for n in args.steps:
        step = jax.jit(functools.partial(decode_steps, r.cfg, r.ops, n, unroll, 0, True), donate_argnums=(1, 2))
        a = r.empty_decode(1)
        a["remaining"][0], a["active"][0] = 10**6, True
        batch = jax.device_put(DecodeBatch(**a, sampling=SamplingArrays.from_params([], [], 1)))
        kv, state, batch, *outs = step(r.params, r.kv, r.state, batch)   # compile
        jax.block_until_ready(outs)
        idle, chained, device = [], [], []
        for _ in range(5):
            t0 = time.perf_counter()
            kv, state, b1, *o1 = step(r.params, kv, state, batch)
            t1 = time.perf_counter()
            kv, state, b2, *o2 = step(r.params, kv, state, b1)      # behind the running one
            t2 = time.perf_counter()
            jax.block_until_ready(o1)
            t3 = time.perf_counter()
            jax.block_until_ready(o2)
            idle.append(t1 - t0)
            chained.append(t2 - t1)
            device.append(t3 - t0)
            batch = b2
        r.kv, r.state = kv, state
        row = dict(steps=n, launch_idle_ms=1e3 * min(idle), launch_chained_ms=1e3 * min(chained),
                   dispatch_ms=1e3 * min(device))
        rows.append(row)
        print("# " + json.dumps(row), flush=True)
    print(f"\n{args.shape}, batch 1, greedy, ops {args.ops}, unrolled layers {unroll}")
    print_table(rows, [("steps per dispatch", "steps", ""), ("launch on idle device ms", "launch_idle_ms", ".3f"),
                       ("launch behind a running one ms", "launch_chained_ms", ".3f"),
                       ("dispatch ms", "dispatch_ms", ".3f")])
    Path(args.out, "launch_cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
