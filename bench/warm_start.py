"""Cold and warm start: a fresh process from launch to its first generated token, twice.

    PYTHONPATH=. python3 bench/warm_start.py [--shape qwen3-4b] [--runs 2] [--out DIR]
    PYTHONPATH=. python3 bench/warm_start.py --serve --max-num-seqs 256   # the server instead

Each run is `jaxinfer generate --max-tokens 1` in a new process (imports, device start, weight
loading, compiling or loading every step from JAX's persistent compilation cache, one prompt),
timed from launch to exit. With --serve, each run starts `jaxinfer serve` and is timed from launch
to the first completion token received over HTTP (a one-token request, retried until the server
answers); the server is then stopped. HOME points at a fresh folder, so the first run starts with an empty
compilation cache and the later ones find what it wrote. Prints the wall time and the loaded /
compiled seconds the engine reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
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
    ap.add_argument("--serve", action="store_true", help="time `jaxinfer serve` to its first served token")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="with --serve")
    args = ap.parse_args()
    from bench.random_model import bench_model

    model_dir = bench_model(args.models, args.shape)
    if not (model_dir / "tokenizer.json").is_file():   # `generate` takes text
        tok = next(Path(d) for d in (args.tokenizer, ".carry/qwen3", "../shared/tokenizers/qwen3") if d and Path(d).is_dir())
        for f in tok.glob("tokenizer*.json"):
            shutil.copy(f, model_dir / f.name)
    home = tempfile.mkdtemp(prefix="jaxinfer-warm-")
    env = {**os.environ, "HOME": home}
    cmd = [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", str(model_dir), "--dtype", args.dtype,
           "--ops", args.ops, "--max-model-len", str(args.max_model_len), "--max-tokens", "1", "1 2 3 4 5"]
    if args.serve:
        port = _free_port()
        cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", str(model_dir), "--dtype", args.dtype,
               "--ops", args.ops, "--max-model-len", str(args.max_model_len), "--port", str(port),
               "--max-num-seqs", str(args.max_num_seqs)]
    rows = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        if args.serve:
            rc, text = _serve_to_first_token(cmd, env, port)
        else:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            rc, text = p.returncode, p.stderr + p.stdout
        wall = time.perf_counter() - t0
        m = re.search(r"loaded in ([\d.]+) s, compiled in ([\d.]+) s", text)
        row = dict(run=i + 1, wall_s=wall, rc=rc, loaded_s=float(m[1]) if m else None,
                   compiled_s=float(m[2]) if m else None)
        # The engine's split of the compiled seconds: "(lower 1.0 s, compile 2.0 s, ...)".
        parts = re.search(r"compiled in [\d.]+ s \(([^)]*)\)", text)
        row["breakdown"] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", parts[1])} if parts else {}
        if rc:
            row["error"] = text.strip().splitlines()[-1][:200] if text.strip() else "?"
        rows.append(row)
        print(f"# {json.dumps(row)}", flush=True)
    what = f"jaxinfer serve --max-num-seqs {args.max_num_seqs}" if args.serve else "jaxinfer generate"
    print(f"\n{what}: {args.shape}, {args.dtype}, ops {args.ops}, max_model_len {args.max_model_len}")
    print("| run | cache | launch to first token s | weights loaded s | steps compiled s | of which: lower / "
          "compile (summed over threads) / compile wall / first runs s | rest (imports, device, server) s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["breakdown"]
        split = " / ".join(f"{b[k]:.1f}" for k in ("lower", "compile", "compile_wall", "first_runs") if k in b)
        rest = r["wall_s"] - (r["loaded_s"] or 0) - (r["compiled_s"] or 0)
        print(f"| {r['run']} | {'cold' if r['run'] == 1 else 'warm'} | {r['wall_s']:.1f} | {r['loaded_s']} | "
              f"{r['compiled_s']} | {split} | {rest:.1f} |" + (f" failed: {r['error']}" if r.get("error") else ""))
    Path(args.out, "warm_start_serve.json" if args.serve else "warm_start.json").write_text(json.dumps(rows, indent=1))
    if any(r["rc"] for r in rows):
        sys.exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_to_first_token(cmd: list[str], env: dict, port: int, timeout: float = 400.0) -> tuple[int, str]:
    """Start the server, send a one-token completion until one comes back; (0 or 1, the server's log)."""
    import httpx

    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    body = {"model": "x", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "temperature": 0}
    rc, deadline = 1, time.perf_counter() + timeout
    try:
        while time.perf_counter() < deadline and proc.poll() is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                body["model"] = models["data"][0]["id"]
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1:
                    rc = 0
                    break
            except (httpx.TransportError, KeyError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        text = log.read()
    return rc, text


if __name__ == "__main__":
    main()
