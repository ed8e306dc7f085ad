"""Kernel time against wall time from a JAX profiler trace (perfetto JSON written by jax.profiler).

    with kernel_trace(log_dir):
        ...                                  # the work to look at
    summary = summarize(log_dir, steps=n)    # per-kernel totals, busy time, gaps

Used by the benches' --profile options to say how much of a step is kernels and how much is the
time between them (launch gaps, host syncs, copies).
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import gzip
import json
import os
import re
from collections import defaultdict

import jax


def keep_command_buffers_when_profiling(profiling: bool = True) -> None:
    """XLA turns CUDA-graph command buffers off while a profiler runs, which adds launch gaps that a
    real step does not have; keep them on. Call before JAX first touches the GPU (reads XLA_FLAGS)."""
    if not profiling:
        return
    flag = "--xla_enable_command_buffers_during_profiling=true"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


@contextlib.contextmanager
def kernel_trace(log_dir: str):
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def _events(log_dir: str, device: bool) -> list[dict]:
    """The trace's complete events with a duration: the devices' (kernels, copies) or the host's."""
    files = sorted(glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {log_dir}")
    data = json.load(gzip.open(files[-1]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "/device:" in n}
    return [e for e in events if e.get("ph") == "X" and (e.get("pid") in device_pids) == device and e.get("dur", 0) > 0]


def summarize_host(log_dir: str, top: int = 40) -> list[dict]:
    """The host's traced activities (XLA's and the runtime's TraceMe scopes, Python calls where traced) by
    total time: name, count, total and largest us. Scopes nest, so the totals overlap (inclusive times)."""
    per = defaultdict(lambda: [0, 0.0, 0.0])
    for e in _events(log_dir, device=False):
        if any(f in e["name"] for f in ("profiler.py", "trace_kernels.py", "contextlib.py")):
            continue   # the trace's own start and stop
        p = per[_short(e["name"])]
        p[0] += 1
        p[1] += e["dur"]
        p[2] = max(p[2], e["dur"])
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return [dict(name=n, count=c, total_us=t, max_us=m) for n, (c, t, m) in ranked]


def request_timeline(log_dir: str, min_us: float = 40.0) -> dict:
    """One traced request on one clock: the host's scopes of at least `min_us` in start order and the device's
    first and last activity, each in us from the trace's first host event. Says whether the device starts
    before the step's launch returns (CUPTI inflates every driver call: the order means more than the sizes)."""
    host = [e for e in _events(log_dir, device=False)
            if not any(f in e["name"] for f in ("profiler.py", "trace_kernels.py", "contextlib.py"))]
    device = sorted(_events(log_dir, device=True), key=lambda e: e["ts"])
    t0 = min(e["ts"] for e in host)
    rows = [dict(name=_short(e["name"]), start_us=e["ts"] - t0, dur_us=e["dur"])
            for e in sorted(host, key=lambda e: e["ts"]) if e["dur"] >= min_us]
    kernels = [e for e in device if "memcpy" not in e["name"].lower() and "memset" not in e["name"].lower()]
    if not kernels:   # the CPU backend's trace has no device activity
        return dict(host=rows[:90], device_first=None, first_kernel_us=None, last_kernel_end_us=None, copies=[])
    return dict(host=rows[:90], device_first=dict(name=_short(device[0]["name"]), start_us=device[0]["ts"] - t0),
                first_kernel_us=kernels[0]["ts"] - t0,
                last_kernel_end_us=max(e["ts"] + e["dur"] for e in kernels) - t0,
                copies=[dict(name=_short(e["name"]), start_us=e["ts"] - t0, dur_us=e["dur"])
                        for e in device if "memcpy" in e["name"].lower()][:8])


def print_request_timeline(t: dict) -> None:
    print("| host scope | start us | us |")
    print("|---|---|---|")
    for r in t["host"]:
        print(f"| {r['name']} | {r['start_us']:.0f} | {r['dur_us']:.0f} |")
    if t["device_first"]:
        print(f"# profile device: first activity {t['device_first']['name']} at {t['device_first']['start_us']:.0f}"
              f" us, first kernel at {t['first_kernel_us']:.0f}, last kernel ends at {t['last_kernel_end_us']:.0f};"
              f" copies {t['copies']}")


def print_host_summary(rows: list[dict]) -> None:
    print("| host activity | count | total us | largest us |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['count']} | {r['total_us']:.0f} | {r['max_us']:.0f} |")


GAP_US = 100.0   # idle gaps at least this long are counted apart (launches, host syncs, waits for the host)


def _short(name: str) -> str:
    """Group kernel instances: drop numeric suffixes (fusion.123 -> fusion)."""
    return re.sub(r"[._]\d+$", "", re.sub(r"\(.*", "", name))[:60]


def summarize(log_dir: str, steps: int) -> dict:
    """Per-step kernel time, busy time (union of kernel intervals), span and copies, over `steps` steps."""
    events = _events(log_dir, device=True)
    kernels = [e for e in events if "memcpy" not in e["name"].lower() and "memset" not in e["name"].lower()]
    copies = [e for e in events if "memcpy" in e["name"].lower()]
    memsets = [e for e in events if "memset" in e["name"].lower()]   # not kernels: they may sit in the gaps
    if not kernels:
        return dict(error="no device kernel events in the trace")
    ordered = sorted(kernels, key=lambda e: e["ts"])
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in ordered]
    busy, cur_s, cur_e = 0.0, *spans[0]
    last = ordered[0]                           # the kernel that ends last so far
    gaps = []                                   # idle time between kernels, us
    pairs = defaultdict(lambda: [0, 0.0])       # (kernel before, kernel after): idle gaps of < GAP_US between them
    for k, (s, e) in zip(ordered[1:], spans[1:]):
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            if s - cur_e < GAP_US:
                p = pairs[(_short(last["name"]), _short(k["name"]))]
                p[0] += 1
                p[1] += s - cur_e
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= last["ts"] + last["dur"]:
            last = k
    busy += cur_e - cur_s
    long_gaps = sorted((g for g in gaps if g >= GAP_US), reverse=True)
    span = spans[-1][1] - spans[0][0]
    per = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        p = per[_short(e["name"])]
        p[0] += 1
        p[1] += e["dur"]
    top = sorted(per.items(), key=lambda kv: -kv[1][1])
    return dict(
        steps=steps, kernels_per_step=len(kernels) / steps, kernel_us_per_step=sum(e["dur"] for e in kernels) / steps,
        busy_us_per_step=busy / steps, span_us_per_step=span / steps,
        gaps_over=dict(us=GAP_US, count=len(long_gaps), total_us=sum(long_gaps), largest_us=long_gaps[:5]),
        short_gaps_us_per_step=sum(g for g in gaps if g < GAP_US) / steps,
        gap_pairs=[dict(before=b, after=a, per_step=c / steps, us_per_step=t / steps, us_each=t / c)
                   for (b, a), (c, t) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[:8]],
        copies_per_step=len(copies) / steps, copy_names=sorted({_short(e["name"]) for e in copies})[:8],
        memsets_per_step=len(memsets) / steps, memset_us_per_step=sum(e["dur"] for e in memsets) / steps,
        memsets_before=_memsets_before(memsets, ordered, steps),
        top=[dict(name=n, per_step=c / steps, us_per_step=t / steps, us_each=t / c) for n, (c, t) in top[:20]])


def _memsets_before(memsets: list[dict], ordered: list[dict], steps: int) -> list[dict]:
    """Which kernel starts next after each memset, grouped: the kernel, memsets per step, their sizes
    (where the trace's args give them) and the idle time from the memset's end to that kernel."""
    starts = [e["ts"] for e in ordered]
    groups = defaultdict(lambda: [0, 0.0, set()])
    for m in memsets:
        i = bisect.bisect_left(starts, m["ts"] + m["dur"])
        nxt = ordered[i] if i < len(ordered) else None
        g = groups[_short(nxt["name"]) if nxt else "(none)"]
        g[0] += 1
        g[1] += (nxt["ts"] - m["ts"] - m["dur"]) if nxt else 0.0
        size = re.search(r"num_bytes:(\d+)", str(m.get("args") or {}))   # CUPTI's "Memset_details" string
        g[2].add(f"{size.group(1)} B" if size else "?")
    return [dict(before=k, per_step=c / steps, idle_us_each=t / c, sizes=sorted(z)[:4])
            for k, (c, t, z) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:8]]


def print_summary(s: dict) -> None:
    if "error" in s:
        print(f"# profile: {s['error']}")
        return
    print(f"# profile over {s['steps']} steps: {s['kernels_per_step']:.1f} kernels/step, kernel time "
          f"{s['kernel_us_per_step']:.0f} us/step, busy {s['busy_us_per_step']:.0f} us/step, span "
          f"{s['span_us_per_step']:.0f} us/step, {s['copies_per_step']:.2f} copies/step {s['copy_names']}, "
          f"{s['memsets_per_step']:.1f} memsets/step ({s['memset_us_per_step']:.1f} us)")
    print("| kernel | per step | us per step | us each |")
    print("|---|---|---|---|")
    for t in s["top"]:
        print(f"| {t['name']} | {t['per_step']:.1f} | {t['us_per_step']:.1f} | {t['us_each']:.2f} |")
    g = s["gaps_over"]
    print(f"# idle between kernels: {s['short_gaps_us_per_step']:.0f} us/step in gaps under {g['us']:.0f} us; "
          f"{g['count']} longer ({g['total_us']:.0f} us in all, largest {[round(x) for x in g['largest_us']]})")
    print("| idle after | before | per step | us per step | us each |")
    print("|---|---|---|---|---|")
    for p in s["gap_pairs"]:
        print(f"| {p['before']} | {p['after']} | {p['per_step']:.1f} | {p['us_per_step']:.1f} | {p['us_each']:.2f} |")
    if s.get("memsets_before"):
        print("| memset before | per step | idle after it, us each | sizes |")
        print("|---|---|---|---|")
        for m in s["memsets_before"]:
            print(f"| {m['before']} | {m['per_step']:.1f} | {m['idle_us_each']:.2f} | {', '.join(m['sizes'])} |")


def trace_engine_decode(engine, prompts: list, params: list, log_dir: str) -> dict:
    """Run one more batch of requests through `engine`, tracing from when every prompt has its first
    token to the end: kernel time against span per decode step."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    started: set[int] = set()
    while len(started) < len(ids) and engine.has_unfinished():
        started.update(d.request_id for d in engine.step() if d.token_ids)
    before = engine.stats["decode_tokens"]
    with kernel_trace(log_dir):
        while engine.has_unfinished():
            engine.step()
    for i in ids:
        engine.take_finished(i)
    summary = summarize(log_dir, steps=max(1, (engine.stats["decode_tokens"] - before) // len(ids)))
    print_summary(summary)
    return summary
