"""Serving load test for an OpenAI-compatible server, in the spirit of `vllm bench serve`.

Requests arrive as a Poisson process at each given rate (gamma-distributed gaps with
--burstiness != 1; `inf` sends them all at once); each streams its answer over SSE. Per rate it
reports request and token throughput and the latencies a client sees:
- TTFT: from sending the request to the first chunk with text;
- TPOT: (end - first text) / (output tokens - 1), per request (output tokens from `usage`);
- ITL: gaps between successive text chunks. The engine runs several decode steps per dispatch,
  so one chunk may carry several tokens: ITL is the time between stream events, and
  tokens/chunk is printed beside it;
- E2E: from sending to the last chunk.

Workload ("random" dataset, as vLLM's): prompt and output lengths are drawn uniformly from
[L * (1 - r), L * (1 + r)] (L = --input-len / --output-len, r = --range-ratio), prompts are random
token ids (no special tokens) sent as token ids to /v1/completions so their lengths are exact,
after an optional shared prefix of --prefix-len tokens; outputs run to their length
(ignore_eos). With --endpoint chat the ids are decoded to text and sent as one user message.

    # against a running server
    python bench/serving.py --base-url http://127.0.0.1:8000 --tokenizer DIR --request-rates 1,4,inf
    # or start one (a subprocess: `jaxinfer serve --model DIR ...`) for the run
    python bench/serving.py --serve-model ../shared/models/stories260k --request-rates 2,8,32,inf

Writes a JSON of every rate's figures (--out) and, with --plot, a PNG of latency against
throughput (matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from jaxinfer.serve.host_profile import shares


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0          # tokens, from usage
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = dataclasses.field(default_factory=list)
    chunks: int = 0
    error: str = ""


# ----------------------------------------------------------------------------- workload


def special_ids(tokenizer) -> set[int]:
    backend = tokenizer.backend
    ids = set(backend.get_added_tokens_decoder()) if hasattr(backend, "get_added_tokens_decoder") else set()
    return ids | set(tokenizer.eos_token_ids)


def make_workload(tokenizer, vocab: int, n: int, input_len: int, output_len: int, ratio: float, prefix_len: int,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    bad = special_ids(tokenizer)
    allowed = np.array([i for i in range(vocab) if i not in bad], dtype=np.int64)

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
        return rng.integers(lo, hi + 1, size=n)

    prefix = rng.choice(allowed, size=prefix_len).tolist()
    return [(prefix + rng.choice(allowed, size=int(li)).tolist(), int(lo))
            for li, lo in zip(lengths(input_len), lengths(output_len))]


# ----------------------------------------------------------------------------- client


@contextlib.asynccontextmanager
async def post_stream(client, url: str, body: dict):
    """POST body as JSON and yield (status, async iterator of response lines, read-all): with an
    httpx.AsyncClient or an aiohttp.ClientSession (vLLM's bench client; a few hundred us less per request)."""
    if isinstance(client, httpx.AsyncClient):
        async with client.stream("POST", url, json=body) as r:
            yield r.status_code, r.aiter_lines(), r.aread
    else:
        async with client.post(url, json=body) as r:
            async def lines():
                async for raw in r.content:
                    yield raw.decode().rstrip("\r\n")
            yield r.status, lines(), r.read


def _client_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (httpx.HTTPError, json.JSONDecodeError)
    try:
        import aiohttp
        errors += (aiohttp.ClientError,)
    except ImportError:
        pass
    return errors


CLIENT_ERRORS = _client_errors()   # what a failed request raises, with either client


async def one_request(client, endpoint: str, model: str, prompt_ids: list[int], output_len: int,
                      tokenizer, extra: dict) -> Result:
    res = Result(ok=False, prompt_len=len(prompt_ids))
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if endpoint == "chat":
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": tokenizer.decode(prompt_ids)}]
    else:
        url = "/v1/completions"
        body["prompt"] = prompt_ids
    t0 = time.perf_counter()
    last = None
    try:
        async with post_stream(client, url, body) as (status, lines, read):
            if status != 200:
                res.error = f"HTTP {status}: {(await read())[:200]!r}"
                return res
            async for line in lines:
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = obj["error"].get("message", "error")
                    return res
                if obj.get("usage"):
                    res.output_len = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices", []):
                    text = ch.get("text") if endpoint != "chat" else (ch.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
        res.latency = (last or time.perf_counter()) - t0
        res.ok = True
    except CLIENT_ERRORS as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


@contextlib.asynccontextmanager
async def open_client(kind: str, base_url: str, headers: dict):
    """The load generator's HTTP client: httpx (default) or aiohttp, unlimited connections, no timeout."""
    if kind == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(base_url, headers=headers, connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=None)) as session:
            yield session
        return
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(None), limits=limits) as c:
        yield c


async def run_rate(base_url: str, api_key: str | None, endpoint: str, model: str, workload, rate: float,
                   burstiness: float, max_concurrency: int | None, tokenizer, seed: int, extra: dict,
                   client_kind: str = "httpx"):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with open_client(client_kind, base_url, headers) as client:
        async def limited(ids, out):
            if sem is None:
                return await one_request(client, endpoint, model, ids, out, tokenizer, extra)
            async with sem:
                return await one_request(client, endpoint, model, ids, out, tokenizer, extra)

        tasks = []
        t_start = time.perf_counter()
        for ids, out in workload:
            tasks.append(asyncio.create_task(limited(ids, out)))
            if math.isfinite(rate):
                # gamma gaps with mean 1/rate; shape = burstiness (1: exponential, a Poisson process)
                await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_start
    return results, duration


def summarize(results: list[Result], duration: float, rate: float) -> dict:
    ok = [r for r in results if r.ok]
    def pct(xs, q):
        return float(np.percentile(xs, q)) * 1000 if xs else math.nan
    def mean(xs):
        return float(np.mean(xs)) * 1000 if xs else math.nan
    ttft = [r.ttft for r in ok if math.isfinite(r.ttft)]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1 and math.isfinite(r.ttft)]
    itl = [x for r in ok for x in r.itl]
    e2e = [r.latency for r in ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    chunks = sum(r.chunks for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "request_rate": rate if math.isfinite(rate) else "inf", "completed": len(ok), "failed": len(results) - len(ok),
        "errors": errors[:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens, "tokens_per_chunk": out_tokens / max(chunks, 1),
        "ttft_ms": {"mean": mean(ttft), "p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "tpot_ms": {"mean": mean(tpot), "p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "itl_ms": {"mean": mean(itl), "p50": pct(itl, 50), "p99": pct(itl, 99)},
        "e2e_ms": {"mean": mean(e2e), "p50": pct(e2e, 50), "p99": pct(e2e, 99)},
    }


def engine_seconds(url: str, headers: dict) -> dict[str, float] | None:
    """A jaxinfer server's engine-thread counters from /metrics (None from other servers)."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        for key, name in (("busy", "jaxinfer_engine_busy_seconds_total"),
                          ("wait", "jaxinfer_engine_device_wait_seconds_total"),
                          ("ttft_sum", "jaxinfer_time_to_first_token_seconds_sum"),
                          ("ttft_count", "jaxinfer_time_to_first_token_seconds_count"),
                          ("queue_sum", "jaxinfer_request_queue_time_seconds_sum"),
                          ("prefill_sum", "jaxinfer_request_prefill_time_seconds_sum"),
                          ("handoff_sum", "jaxinfer_first_token_handoff_seconds_sum"),
                          ("parse_sum", "jaxinfer_request_parse_seconds_sum"),
                          ("split_count", "jaxinfer_first_token_handoff_seconds_count"),
                          ("steps_sum", "jaxinfer_request_prefill_steps_sum")):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
        # the event loop's wake-up lag: mean, and the samples later than 1 and 5 ms
        m = re.match(r'^jaxinfer_event_loop_lag_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$', line)
        if m:
            out[f"lag_{m.group(1)}"] = float(m.group(2))
        m = re.match(r'^jaxinfer_event_loop_lag_seconds_bucket\{.*le="([^"]+)".*\} (\S+)$', line)
        if m and m.group(1) in ("0.001", "0.005"):
            out[f"lag_le_{m.group(1)}"] = float(m.group(2))
        # the engine thread's seconds by phase: phase_<name>
        m = re.match(r'^jaxinfer_engine_phase_seconds_total\{.*phase="(\w+)".*\} (\S+)$', line)
        if m:
            out[f"phase_{m.group(1)}"] = float(m.group(2))
        # Python's garbage collections by generation: gc<gen>_sum / _count
        m = re.match(r'^jaxinfer_gc_pause_seconds_(sum|count)\{.*generation="(\d)".*\} (\S+)$', line)
        if m:
            out[f"gc{m.group(2)}_{m.group(1)}"] = float(m.group(3))
        # mixed steps by token bucket: mixed_<tokens>_sum / _count
        m = re.match(r'^jaxinfer_engine_mixed_step_seconds_(sum|count)\{.*tokens="(\d+)".*\} (\S+)$', line)
        if m:
            out[f"mixed_{m.group(2)}_{m.group(1)}"] = float(m.group(3))
    return out if len(out) >= 9 else None


def server_breakdown(before: dict, after: dict, duration: float) -> dict:
    """What a jaxinfer server's /metrics say of one rate (`engine_seconds` before and after it): the
    engine thread's shares, the server's TTFT and its parts, steps to the first token, the prefill steps
    by token bucket, the event loop's lag."""
    def d(key):
        return after.get(key, 0) - before.get(key, 0)

    def per(x, n):
        return x / n if n else math.nan

    busy, wait = d("busy"), d("wait")
    n = d("split_count")
    out = dict(
        engine_thread=dict(busy=busy / duration, device_wait=wait / duration, host=(busy - wait) / duration),
        # the server's own TTFT (arrival to the first token id on its event loop; the client's waits for
        # the first chunk with text, which a token ending mid-character delays) ...
        server_ttft_mean_ms=1e3 * per(d("ttft_sum"), d("ttft_count")),
        # ... in parts: waiting to be taken in, the engine's steps to the first token, back to the loop;
        # and the body's parse, before the server's clock starts
        server_ttft_split_ms={part: 1e3 * per(d(f"{part}_sum"), n) for part in ("queue", "prefill", "handoff", "parse")})
    if "steps_sum" in after:
        out["prefill_steps_mean"] = per(d("steps_sum"), n)
    # the mixed (prefill) steps of this rate, by token bucket: how many, and their mean wall time
    buckets = sorted((int(k.split("_")[1]) for k in after if k.startswith("mixed_") and k.endswith("_count")))
    out["mixed_steps"] = {str(t): dict(count=int(d(f"mixed_{t}_count")),
                                       mean_ms=1e3 * per(d(f"mixed_{t}_sum"), d(f"mixed_{t}_count")))
                          for t in buckets if d(f"mixed_{t}_count")}
    phases = [k[len("phase_"):] for k in after if k.startswith("phase_")]
    if phases:   # share of the rate's wall time the engine thread spent in each phase
        out["engine_phases"] = {p: d(f"phase_{p}") / duration for p in phases}
    gens = sorted(k[2] for k in after if re.fullmatch(r"gc\d_count", k))
    if gens:   # collections during the rate and their total pause, by generation
        out["gc_pauses"] = {g: dict(count=int(d(f"gc{g}_count")), total_ms=1e3 * d(f"gc{g}_sum"),
                                    mean_ms=1e3 * per(d(f"gc{g}_sum"), d(f"gc{g}_count"))) for g in gens}
    if "lag_count" in after:
        k = d("lag_count")
        out["event_loop_lag"] = dict(samples=int(k), mean_ms=1e3 * per(d("lag_sum"), k),
                                     over_1ms=per(k - d("lag_le_0.001"), k), over_5ms=per(k - d("lag_le_0.005"), k))
    return out


class TraceWindow(threading.Thread):
    """Trace the server's device (its /debug/device_trace routes) from `delay` s for `seconds` s, in the
    background; `result` is the trace's folder, or an error message."""

    def __init__(self, url: str, headers: dict, name: str, delay: float, seconds: float):
        super().__init__(daemon=True)
        self.url, self.headers, self.name, self.delay, self.seconds = url, headers, name, delay, seconds
        self.result: str = "not run"
        self.start()

    def run(self) -> None:
        time.sleep(self.delay)
        try:
            r = httpx.post(self.url + "/debug/device_trace/start", params={"name": self.name}, headers=self.headers,
                           timeout=60)
            if r.status_code != 200:
                self.result = f"start: HTTP {r.status_code} {r.text[:200]}"
                return
            time.sleep(self.seconds)
            r = httpx.post(self.url + "/debug/device_trace/stop", headers=self.headers, timeout=300)
            self.result = r.json()["dir"] if r.status_code == 200 else f"stop: HTTP {r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            self.result = f"{type(e).__name__}: {e}"


def device_trace_summary(result: str) -> dict:
    """The device's busy share and idle gaps over a traced window (bench/trace_kernels.summarize)."""
    from bench.trace_kernels import summarize

    if not Path(result).is_dir():
        return dict(error=result)
    try:
        s = summarize(result, steps=1)
    except (FileNotFoundError, OSError, ValueError) as e:
        return dict(error=f"{type(e).__name__}: {e}")
    if "error" in s:
        return s
    return dict(dir=result, span_ms=s["span_us_per_step"] / 1e3, busy_share=s["busy_us_per_step"] / s["span_us_per_step"],
                kernels=s["kernels_per_step"], gaps=s["gaps_over"], top=s["top"][:8])


PROFILED_THREADS = ("jaxinfer-engine", "MainThread")   # the engine's thread and the event loop's


def host_profile_report() -> dict | None:
    path = os.environ.get("JAXINFER_HOST_PROFILE")
    if not path or not Path(path).is_file():
        return None
    return json.loads(Path(path).read_text())


def having(rows: list[dict], key: str):
    """(row, row[key]) for the rows (one a rate) that have key."""
    return ((s, s[key]) for s in rows if key in s)


def print_table(rows: list[dict]) -> None:
    head = (f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'tok/chunk':>9}")
    print(head)
    for s in rows:
        print(f"{s['request_rate']:>6} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>7.2f} "
              f"{s['output_throughput']:>10.1f} {s['total_token_throughput']:>10.1f} "
              f"{s['ttft_ms']['p50']:>9.1f} {s['ttft_ms']['p99']:>8.1f} {s['tpot_ms']['p50']:>9.2f} "
              f"{s['tpot_ms']['p99']:>8.2f} {s['itl_ms']['p50']:>8.2f} {s['itl_ms']['p99']:>8.2f} "
              f"{s['tokens_per_chunk']:>9.2f}")
    print("(latencies in ms; ITL = gap between stream chunks, which carry tok/chunk tokens on average)")
    if any("engine_thread" in s for s in rows):
        print("engine thread, share of wall time: busy = blocked on the device + host work (Python: scheduling,")
        print("batch building, dispatch, detokenizing); host near 100% would make the host the bottleneck")
        for s, e in having(rows, "engine_thread"):
            print(f"{s['request_rate']:>6}  busy {100 * e['busy']:5.1f}%  "
                  f"device wait {100 * e['device_wait']:5.1f}%  host {100 * e['host']:5.1f}%  "
                  f"(server-side TTFT mean {s['server_ttft_mean_ms']:.1f} ms; client-side "
                  f"{s['ttft_ms']['mean']:.1f})")
        print("server-side TTFT, mean ms: queue (arrival until the engine thread takes the request in) + prefill")
        print("(the engine's steps to the first token) + handoff (back to the event loop); client-side - server-side")
        print("= parse (reading and validating the body, before the server's clock starts) + the network both")
        print("ways + a first token whose text waits for the next one")
        for s, q in having(rows, "server_ttft_split_ms"):
            print(f"{s['request_rate']:>6}  queue {q['queue']:7.2f}  prefill {q['prefill']:7.2f}  "
                  f"handoff {q['handoff']:6.2f}  client - server "
                  f"{s['ttft_ms']['mean'] - s['server_ttft_mean_ms']:6.2f} (parse {q['parse']:5.2f})")
        print("event loop: how late it wakes from a 5 ms sleep (mean; share of wake-ups later than 1 and 5 ms)")
        for s, lag in having(rows, "event_loop_lag"):
            print(f"{s['request_rate']:>6}  lag {lag['mean_ms']:6.2f} ms  > 1 ms {100 * lag['over_1ms']:5.1f}%  "
                  f"> 5 ms {100 * lag['over_5ms']:5.1f}%  ({lag['samples']} wake-ups)")
        print("engine thread by phase, share of wall time: run = a mixed step's call and read-back (mostly the")
        print("device); chain/collect = decode dispatches launched / read back; the rest is host work between steps")
        for s, ph in having(rows, "engine_phases"):
            print(f"{s['request_rate']:>6}  " + "  ".join(f"{p} {100 * v:.1f}%" for p, v in ph.items()))
        print("Python's garbage collections during the rate, by generation: count x mean ms (total ms)")
        for s, gcs in having(rows, "gc_pauses"):
            print(f"{s['request_rate']:>6}  " + ", ".join(f"gen {g}: {v['count']} x {v['mean_ms']:.2f} ({v['total_ms']:.1f})"
                                                      for g, v in gcs.items()))
        print("engine steps from take-in to the first token (mean), and the mixed (prefill) steps by token bucket:")
        print("count x mean ms on the engine thread, from the later of its launch and the previous mixed read-back to")
        print("its own read-back (host work + device + read-back; steps read back late counted once)")
        for s, mixed in having(rows, "mixed_steps"):
            print(f"{s['request_rate']:>6}  steps to first token {s.get('prefill_steps_mean', math.nan):5.2f}  mixed: "
                  + ", ".join(f"{t}: {v['count']} x {v['mean_ms']:.2f}" for t, v in mixed.items()))
    for s, t in having(rows, "device_trace"):
        if "error" in t:
            print(f"device trace, rate {s['request_rate']}: {t['error']}")
            continue
        g = t["gaps"]
        print(f"device trace, rate {s['request_rate']}: busy {100 * t['busy_share']:.1f}% of {t['span_ms']:.0f} ms, "
              f"{t['kernels']:.0f} kernels; idle gaps >= {g['us']:.0f} us: {g['count']}, {g['total_us'] / 1e3:.1f} ms "
              f"(largest {', '.join(f'{x / 1e3:.2f}' for x in g['largest_us'])} ms); top kernels: "
              + ", ".join(f"{k['name']} {k['us_per_step'] / 1e3:.1f} ms" for k in t["top"][:5]))
    for s in rows:
        for thread, p in s.get("host_profile", {}).items():
            print(f"host profile, rate {s['request_rate']}, thread {thread}: {p['samples']} busy samples ({p['idle']} idle "
                  "left out); share of the busy samples:")
            for kind in ("self", "total"):
                print(f"  {kind:>5}: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in p[kind].items()))


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["output_throughput"] for s in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [s[key][q] for s in rows], style, label=f"{name} {q}")
        for s in rows:
            ax.annotate(str(s["request_rate"]), (s["output_throughput"], s[key]["p50"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title + " (labels: request rate, req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------- server


def start_server(args) -> tuple[subprocess.Popen, str]:
    from jaxinfer.serve.server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--model", args.serve_model, "--port", str(port),
           "--log-level", "warning", *shlex.split(args.serve_args)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    print("[starting:", " ".join(cmd), "]", file=sys.stderr)
    env = dict(os.environ)
    if args.device_trace:   # the server's /debug/device_trace routes, command buffers kept on while tracing
        env["JAXINFER_DEVICE_TRACE"] = str(Path(args.device_trace).resolve())
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not come up in time")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--serve-model", default=None, help="start `jaxinfer serve --model DIR` for the run instead")
    p.add_argument("--serve-args", default="", help="more arguments for that server, e.g. '--max-num-seqs 64'")
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--tokenizer", default=None, help="model folder with the tokenizer (default: --serve-model)")
    p.add_argument("--model", default=None, help="served model name (default: the server's only model)")
    p.add_argument("--api-key", default=os.environ.get("JAXINFER_API_KEY"))
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--request-rates", default="1,4,16,inf", help="comma-separated requests/s; inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    p.add_argument("--prefix-len", type=int, default=0, help="a prefix of this many tokens shared by every prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of latency against throughput here")
    p.add_argument("--device-trace", default=None, metavar="DIR",
                   help="with --serve-model: trace the server's device for --device-trace-seconds of each rate "
                        "(from a third of the way in; all-at-once rates from 0.2 s) and print its busy share and "
                        "idle gaps; traces under DIR/rate-R")
    p.add_argument("--device-trace-seconds", type=float, default=1.0)
    p.add_argument("--client", choices=["httpx", "aiohttp"], default="httpx",
                   help="the load generator's HTTP client (aiohttp: as vLLM's bench; needs aiohttp)")
    args = p.parse_args(argv)
    if not (args.base_url or args.serve_model):
        p.error("give --base-url or --serve-model")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")

    from jaxinfer.model.config import load_config
    from jaxinfer.text import Tokenizer

    tok_dir = args.tokenizer or args.serve_model
    if tok_dir is None:
        p.error("give --tokenizer DIR (the model folder) to build prompts")
    tokenizer = Tokenizer.from_dir(tok_dir)
    vocab = load_config(tok_dir).vocab_size if (Path(tok_dir) / "config.json").exists() else tokenizer.vocab_size
    rates = [float(r) for r in args.request_rates.split(",")]

    proc = None
    url = args.base_url
    if args.serve_model:
        proc, url = start_server(args)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"]
        model = args.model or models[0]["id"]
        max_len = models[0].get("max_model_len")
        if max_len and args.prefix_len + args.input_len * (1 + args.range_ratio) + args.output_len * (1 + args.range_ratio) > max_len:
            raise SystemExit(f"prompt + output lengths may pass the server's max_model_len {max_len}")
        extra = json.loads(args.extra_body)
        warm = make_workload(tokenizer, vocab, 2, args.input_len, 4, 0.0, args.prefix_len, args.seed + 1)
        asyncio.run(run_rate(url, args.api_key, args.endpoint, model, warm, math.inf, 1.0, None, tokenizer, 0, extra,
                             args.client))
        rows = []
        for i, rate in enumerate(rates):
            workload = make_workload(tokenizer, vocab, args.num_prompts, args.input_len, args.output_len,
                                     args.range_ratio, args.prefix_len, args.seed + 100 + i)
            before = engine_seconds(url, headers)
            prof_before = host_profile_report()
            tracer = None
            if args.device_trace and args.serve_model:
                delay = 0.2 if math.isinf(rate) else args.num_prompts / rate / 3
                tracer = TraceWindow(url, headers, f"rate-{rate}", delay, args.device_trace_seconds)
            results, duration = asyncio.run(run_rate(url, args.api_key, args.endpoint, model, workload, rate,
                                                     args.burstiness, args.max_concurrency, tokenizer, args.seed + i,
                                                     extra, args.client))
            rows.append(summarize(results, duration, rate))
            after = engine_seconds(url, headers)
            if before and after:   # a jaxinfer server: where its engine thread's time went
                rows[-1].update(server_breakdown(before, after, duration))
            if tracer is not None:
                tracer.join()
                rows[-1]["device_trace"] = device_trace_summary(tracer.result)
            if prof_before is not None:   # the server samples its threads (JAXINFER_HOST_PROFILE)
                time.sleep(0.3)           # its next write covers the whole rate
                after_prof = host_profile_report()
                rows[-1]["host_profile"] = {t: shares(prof_before, after_prof, t) for t in PROFILED_THREADS}
            print(f"[rate {rate}: {rows[-1]['completed']} done, {rows[-1]['failed']} failed in "
                  f"{duration:.1f} s{'; ' + rows[-1]['errors'][0] if rows[-1]['errors'] else ''}]", file=sys.stderr)
        print_table(rows)
        meta = {k: v for k, v in vars(args).items() if k not in ("api_key",)}
        meta.update(model=model, url=url, command=" ".join(shlex.quote(a) for a in sys.argv))
        if args.out:
            Path(args.out).write_text(json.dumps({"config": meta, "results": rows}, indent=2))
        if args.plot:
            try:
                plot(rows, args.plot, f"{model}: in {args.input_len}, out {args.output_len}, {args.endpoint}")
            except ImportError:
                print("[--plot needs matplotlib; no PNG written]", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
