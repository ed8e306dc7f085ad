"""Cold and warm start: a fresh process from launch to its first generated token, twice.

    PYTHONPATH=. python3 bench/warm_start.py [--shape qwen3-4b] [--runs 2] [--out DIR]

Each run is `jaxinfer generate --max-tokens 1` in a new process (imports, device start, weight
loading, compiling or loading every step from JAX's persistent compilation cache, one prompt),
timed from launch to exit. HOME points at a fresh folder, so the first run starts with an empty
compilation cache and the later ones find what it wrote. Prints the wall time and the loaded /
compiled seconds the engine reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ops", default="pallas")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: .carry/qwen3 or ../shared/tokenizers/qwen3)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from jaxinfer.random_model import bench_model

    model_dir = bench_model(args.models, args.shape)
    if not (model_dir / "tokenizer.json").is_file():   # `generate` takes text
        tok = next(Path(d) for d in (args.tokenizer, ".carry/qwen3", "../shared/tokenizers/qwen3") if d and Path(d).is_dir())
        for f in tok.glob("tokenizer*.json"):
            shutil.copy(f, model_dir / f.name)
    home = tempfile.mkdtemp(prefix="jaxinfer-warm-")
    env = {**os.environ, "HOME": home}
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(model_dir), "--dtype", args.dtype,
           "--ops", args.ops, "--max-model-len", str(args.max_model_len), "--max-tokens", "1", "1 2 3 4 5"]
    rows = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        m = re.search(r"loaded in ([\d.]+) s, compiled in ([\d.]+) s", p.stderr + p.stdout)
        row = dict(run=i + 1, wall_s=wall, rc=p.returncode, loaded_s=float(m[1]) if m else None,
                   compiled_s=float(m[2]) if m else None)
        if p.returncode:
            row["error"] = (p.stderr or p.stdout).strip().splitlines()[-1][:200]
        rows.append(row)
        print(f"# {json.dumps(row)}", flush=True)
    print(f"\n{args.shape}, {args.dtype}, ops {args.ops}, max_model_len {args.max_model_len}")
    print("| run | cache | process wall s | weights loaded s | steps compiled s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {'cold' if r['run'] == 1 else 'warm'} | {r['wall_s']:.1f} | {r['loaded_s']} | "
              f"{r['compiled_s']} |" + (f" failed: {r['error']}" if r.get("error") else ""))
    Path(args.out, "warm_start.json").write_text(json.dumps(rows, indent=1))
    if any(r["rc"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
