"""Host time to trace and lower one compiled step, the part of start-up the persistent cache cannot skip.

    PYTHONPATH=. python3 bench/trace_cost.py [--layers 36] [--ops reference pallas-interpret]

A random model of the TINY shape with `--layers` layers (the cost grows with the layer count, not the
width), per-layer weights as the engine uses on GPUs; for each op set it times jit(...).trace() and
.lower() of a decode step (8 steps, batch 4) and a mixed step (64 tokens). Prints one table.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import jax

from bench.table import print_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--ops", nargs="*", default=["reference", "pallas-interpret"])
    ap.add_argument("--models", default=None, help="folder for the random model (default: a temporary one)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxinfer.runner.batch import StepBatch
    from jaxinfer.model.config import load_config
    from jaxinfer.model.transformer import split_layers
    from jaxinfer.ops import get_ops
    from bench.random_model import TINY, write_random_model
    from jaxinfer.runner.model_runner import DecodeBatch, ModelRunner, decode_steps, mixed_step
    from jaxinfer.sampling.sample import SamplingArrays
    from jaxinfer.model.weights import load_params

    d = write_random_model(f"{args.models or tempfile.mkdtemp()}/tiny-{args.layers}-layers", {**TINY, "num_hidden_layers": args.layers}, dtype="float32")
    cfg = load_config(d, "float32")
    params = split_layers(load_params(d, cfg, progress=False))
    rows = []
    for name in args.ops:
        ops = get_ops(name)
        r = ModelRunner(cfg, params, ops, num_pages=64, page_size=16, max_num_seqs=4, max_model_len=256,
                        max_num_batched_tokens=64, steps_per_decode=8, unroll_layers=True, max_logprobs=0)
        steps = {
            "decode": (jax.jit(functools.partial(decode_steps, cfg, ops, 8, True, 0, True), donate_argnums=(1, 2)),
                       DecodeBatch(**r.empty_decode(4), sampling=SamplingArrays.from_params([], [], 4))),
            "mixed": (jax.jit(functools.partial(mixed_step, cfg, ops, 0), donate_argnums=(1, 2)),
                      StepBatch(**r.empty_mixed(64), sampling=SamplingArrays.from_params([], [], 4))),
        }
        for kind, (f, batch) in steps.items():
            t0 = time.perf_counter()
            traced = f.trace(params, r.kv, r.state, batch)
            t1 = time.perf_counter()
            traced.lower()
            t2 = time.perf_counter()
            rows.append(dict(ops=name, step=kind, trace_s=t1 - t0, lower_s=t2 - t1))
    print(f"\n{args.layers} layers, {jax.default_backend()}")
    print_table(rows, [("ops", "ops", ""), ("step", "step", ""), ("trace s", "trace_s", ".2f"),
                       ("lower s", "lower_s", ".2f")])
    Path(args.out, "trace_cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
