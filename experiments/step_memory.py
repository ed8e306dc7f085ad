"""Device memory of each compiled step, as XLA planned it: a copy of the KV pool would show here.

    PYTHONPATH=. python3 bench/step_memory.py [--shape qwen3-4b] [--max-num-seqs 64] [--out DIR]

Starts an engine as `jaxinfer serve` would (the KV pool sized from the memory left, every bucket
compiled or loaded from the executable cache) and prints, for every compiled step, XLA's memory
analysis: arguments, outputs, the part of the outputs aliased to donated arguments (the KV cache and
the sampler state), and temporaries. A step that updated the KV cache out of place would need
temporaries the size of the pool (87 GB for Qwen3-4B at max-num-seqs 64 on the H200); compiling the
2,048-token step logs XLA rematerialization warnings that count 255 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.table import print_table

GIB = 2 ** 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxinfer.engine.engine import Engine
    from bench.random_model import bench_model
    from jaxinfer.runner.model_runner import bucket_of

    model_dir = bench_model(args.models, args.shape)
    engine = Engine(model_dir, dtype=args.dtype, ops=args.ops, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, skip_tokenizer_init=True, progress=False)
    r = engine.runner
    print(f"# KV pool {engine.kv_bytes / GIB:.2f} GiB; {len(r.bucket_calls())} steps", flush=True)
    rows = []
    for name, batch in r.bucket_calls():
        for part, exe in r.compiled(name, batch):   # a split prompt step's two executables apart
            m = exe.memory_analysis()
            rows.append(dict(step=f"{part} {bucket_of(batch)}", arguments=m.argument_size_in_bytes / GIB,
                             outputs=m.output_size_in_bytes / GIB, aliased=m.alias_size_in_bytes / GIB,
                             temporaries=m.temp_size_in_bytes / GIB,
                             # K and V are the pool's two arrays: a plan that copies either holds >= 1 of them in
                             # temporaries or in outputs not aliased to their donated arguments
                             per_kv=max(m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes)
                             / (engine.kv_bytes / 2)))
            print(f"# {json.dumps(rows[-1])}", flush=True)
    print(f"\n{args.shape}, {args.dtype}, ops {args.ops}, max_num_seqs {args.max_num_seqs}, "
          f"KV pool {engine.kv_bytes / GIB:.2f} GiB (GiB per step, XLA's memory analysis)")
    print_table(rows, [("step", "step", ""), ("arguments", "arguments", ".2f"), ("outputs", "outputs", ".2f"),
                       ("aliased to donated arguments", "aliased", ".2f"), ("temporaries", "temporaries", ".3f"),
                       ("max(temporaries, unaliased outputs) / K's size", "per_kv", ".3f")])
    Path(args.out, "step_memory.json").write_text(json.dumps(dict(kv_gib=engine.kv_bytes / GIB, rows=rows), indent=1))


if __name__ == "__main__":
    main()
