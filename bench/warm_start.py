"""Start-up to the first token, cold and warm: a fresh process each run, as a user starts one.

    PYTHONPATH=. python3 bench/warm_start.py [--shape qwen3-4b] [--runs 2] [--out DIR]
    PYTHONPATH=. python3 bench/warm_start.py --serve [--max-num-seqs N] [--max-model-len N]   # the server instead

generate: each run is `jaxinfer generate --model DIR "1 2 3 4 5"` and no other flag, so the defaults pick what a
user gets (the checkpoint's dtype, the Pallas kernels on a GPU, steps compiled on first use). It is timed from
launch to the first generated text on its stdout: imports, device start, weight loading, compiling (or loading
from the caches) the steps the prompt takes, and the prompt step. The process then runs to its end (its steps
land in the caches for the next run); launch to exit is reported beside.
serve: each run starts `jaxinfer serve --model DIR --port P` (it compiles every step at start-up), timed from
launch to the first completion token received over HTTP (a one-token request, retried until the server answers);
the server is then stopped.
Every run's HOME is one fresh folder, so the default cache dir (~/.cache/jaxinfer: JAX's compilation cache in
jax/, whole executables in executables/) is empty for the first run (cold) and holds what the earlier runs wrote
for the later ones (warm). The model folder is bench.random_model's bench_model(--models, --shape) (random bf16
weights) with a Qwen3 tokenizer copied in. Prints a table (run, cold/warm, seconds to the first token, the
engine's summary line) and writes warm_start.json (warm_start_serve.json with --serve) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "1 2 3 4 5"   # token ids below 4,096 in Qwen3's tokenizer: the tiny shape's vocabulary takes them
TOKENIZERS = (".carry/qwen3", "shared/tokenizers/qwen3", "../shared/tokenizers/qwen3")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--runs", type=int, default=2, help="the first cold, the others warm")
    ap.add_argument("--models", default="/tmp/jaxinfer-bench-models")
    ap.add_argument("--tokenizer", default=None, help=f"tokenizer folder (default: the first of {', '.join(TOKENIZERS)})")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take to its first token")
    ap.add_argument("--serve", action="store_true", help="time `jaxinfer serve` to its first served token")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="with --serve (default: the server's)")
    ap.add_argument("--max-model-len", type=int, default=None, help="with --serve (default: the server's)")
    args = ap.parse_args()
    from bench.random_model import bench_model

    model_dir = bench_model(args.models, args.shape)
    if not (model_dir / "tokenizer.json").is_file():   # `generate` takes text; the server loads one too
        found = [Path(d) for d in (args.tokenizer, *TOKENIZERS) if d and (Path(d) / "tokenizer.json").is_file()]
        if not found:
            raise SystemExit(f"no tokenizer.json in --tokenizer or {', '.join(TOKENIZERS)}")
        for f in found[0].glob("tokenizer*.json"):
            shutil.copy(f, model_dir / f.name)
    home = tempfile.mkdtemp(prefix="jaxinfer-warm-")
    env = {**os.environ, "HOME": home}
    jaxinfer = [sys.executable, "-m", "jaxinfer.cli"]
    if args.serve:
        port = _free_port()
        extra = [*(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []),
                 *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
        cmd = ["serve", "--model", str(model_dir), "--port", str(port), *extra]
    else:
        cmd = ["generate", "--model", str(model_dir), PROMPT]
    shown = "jaxinfer " + shlex.join(cmd)
    print(f"# {shown}  (a fresh process each run, HOME={home})", flush=True)
    rows = []
    for i in range(args.runs):
        if args.serve:
            row = _serve_to_first_token(jaxinfer + cmd, env, port, args.timeout)
        else:
            row = _generate_to_first_token(jaxinfer + cmd, env, args.timeout)
        log = row.pop("log")
        summary = next((line.strip() for line in log.splitlines() if line.startswith("[jaxinfer:")), None)
        loaded = re.search(r"loaded in ([\d.]+) s", summary or "")
        compiled = re.search(r"compiled (\d+) steps in ([\d.]+) s", summary or "")
        row = dict(run=i + 1, cache="cold" if i == 0 else "warm", **row, summary=summary,
                   loaded_s=float(loaded[1]) if loaded else None,
                   compiled_steps=int(compiled[1]) if compiled else None,
                   compiled_s=float(compiled[2]) if compiled else None)
        if row["rc"]:
            row["error"] = log.strip().splitlines()[-1][:300] if log.strip() else "?"
        rows.append(row)
        print(f"# {json.dumps(row)}", flush=True)
    print(f"\n{shown}: {args.shape}")
    print("| run | cache | launch to first token s | engine summary |")
    print("|---|---|---|---|")
    for r in rows:
        first = f"{r['first_token_s']:.1f}" if r["first_token_s"] is not None else "-"
        print(f"| {r['run']} | {r['cache']} | {first} | {r['summary'] or '-'} |"
              + (f" failed: {r['error']}" if r.get("error") else ""))
    out = Path(args.out, "warm_start_serve.json" if args.serve else "warm_start.json")
    out.write_text(json.dumps(dict(command=shown, shape=args.shape, home=home, rows=rows), indent=1))
    if any(r["rc"] for r in rows):
        sys.exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate_to_first_token(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run `jaxinfer generate`; the first token is the first write to its stdout (the prompt and the first
    token's text, flushed together). {rc, first_token_s, exit_s, log: its stderr}."""
    log = tempfile.TemporaryFile(mode="w+")   # a file, not a pipe: a chatty stderr cannot block the child
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log)
    first, out = None, b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while first is None and time.perf_counter() - t0 < timeout:
            if not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:   # the process closed its stdout without a token
                break
            first, out = time.perf_counter() - t0, chunk
    try:
        rest, _ = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
    exit_s = time.perf_counter() - t0
    log.seek(0)
    text = log.read()
    rc = proc.returncode or (first is None)
    if first is not None and not out.decode(errors="replace").startswith(PROMPT):
        rc, text = 1, text + f"\nunexpected first output: {out[:200]!r}"
    return dict(rc=int(rc), first_token_s=first, exit_s=exit_s, output=(out + rest).decode(errors="replace")[:200],
                log=text)


def _serve_to_first_token(cmd: list[str], env: dict, port: int, timeout: float) -> dict:
    """Start the server, send a one-token completion until one comes back, stop it. {rc, first_token_s, log}."""
    import httpx

    log = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    body = {"model": "x", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "temperature": 0}
    rc, first = 1, None
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
                body["model"] = models["data"][0]["id"]
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1:
                    rc, first = 0, time.perf_counter() - t0
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
            proc.wait()
        log.seek(0)
        text = log.read()
    return dict(rc=rc, first_token_s=first, log=text)


if __name__ == "__main__":
    main()
