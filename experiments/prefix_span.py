"""Time to first token of a request whose system prompt is cached, by the page table's span: the prefixed
cuDNN path (EngineConfig.prefixed_chunk_attention) gathers the prefix's K/V at the page row's whole span
(max_model_len), so with the server's 40,960 a short prefix may cost as much as a long one.

    PYTHONPATH=. python3 bench/prefix_span.py [--shape qwen3-4b] [--system 2048] [--new 8 1024]
        [--spans 4096 40960] [--out DIR]

For each span (max_model_len) and attention for the chunk after the prefix (prefixed cuDNN, or the paged
kernel): one engine (prefix caching on, one sequence, steps compiled when first run), the system prompt
run once to fill the cache, then the best of 3 requests of system + `new` fresh tokens (cached prefix, one
chunk after it), as TTFT ms. Prints one table; JSON to $OUT/prefix_span.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import numpy as np

from bench.table import print_table
from bench.throughput import run_all


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--new", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--spans", type=int, nargs="+", default=[4096, 40960])
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxinfer.engine.engine import Engine
    from bench.random_model import bench_model
    from jaxinfer.sampling import SamplingParams

    model_dir = bench_model(args.models, args.shape)
    rng = np.random.default_rng(0)
    system = rng.integers(100, 1000, args.system).tolist()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    rows = []
    for span in args.spans:
        for prefixed in (True, False):
            engine = Engine(model_dir, dtype="bfloat16", ops=args.ops, max_num_seqs=1, max_model_len=span,
                            max_num_batched_tokens=2048, enable_prefix_caching=True, compile_at_start=False,
                            prefixed_chunk_attention=prefixed, progress=False, skip_tokenizer_init=True)
            row = dict(span=span, attention="prefixed" if prefixed else "paged")
            for n in args.new:
                times = []
                for i in range(4):   # the first fills the cache and compiles
                    times.append(run_all(engine, [system + rng.integers(100, 1000, n).tolist()], [one])[0])
                row[f"new{n}_ms"] = 1e3 * min(times[1:])
            rows.append(row)
            print(f"# {json.dumps(row)}", flush=True)
            del engine
            gc.collect()
    print(f"\n{args.shape}, ops {args.ops}: TTFT with a cached {args.system}-token prefix, by span and attention")
    print_table(rows, [("span", "span", ""), ("attention", "attention", "")] +
                [(f"{n} new tokens, ms", f"new{n}_ms", ".2f") for n in args.new])
    Path(args.out, "prefix_span.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
