"""A sampling profiler of the server's Python threads, for finding where host time goes under load.

Set `JAXINFER_HOST_PROFILE=PATH` before `jaxinfer serve`: a daemon thread then reads every thread's
stack (`sys._current_frames()`) every 2 ms and rewrites PATH with JSON counts per thread four times a
second: busy samples, idle ones (waiting for work), the innermost function of each busy sample
(self) and every function on its stack (total). `shares(before, after, thread)` turns two reports
into shares of that thread's busy samples in between (bench/serving.py prints them per request
rate). No dependency and no ptrace (py-spy needs it), so it runs wherever the server runs. A sample
cannot tell running from waiting for the GIL: both show the line the thread is at.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time


# Where a server thread waits for work: the engine thread blocked on its empty command queue.
IDLE = ("async_engine.py:_take_commands",)


def _where(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class HostProfiler:
    def __init__(self, path: str, interval: float = 0.002, write_every: float = 0.25):
        self.path, self.interval, self.write_every = path, interval, write_every
        self.samples: collections.Counter = collections.Counter()       # thread name -> busy samples
        self.idle: collections.Counter = collections.Counter()          # thread name -> idle samples
        self.self_: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxinfer-host-profiler", daemon=True)

    def start(self) -> "HostProfiler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.write()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, str(ident))
            leaf = _where(frame.f_code)
            if leaf in IDLE:            # counted apart: a busy thread's shares leave these out
                self.idle[name] += 1
                continue
            self.samples[name] += 1
            self.self_[name][leaf] += 1
            seen = set()
            while frame is not None:
                w = _where(frame.f_code)
                if w not in seen:
                    seen.add(w)
                    self.total[name][w] += 1
                frame = frame.f_back

    def summary(self) -> dict:
        threads = {name: dict(samples=self.samples[name], idle=self.idle[name], self=dict(self.self_[name]),
                              total=dict(self.total[name])) for name in set(self.samples) | set(self.idle)}
        return dict(interval_s=self.interval, threads=threads)

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1)
        os.replace(tmp, self.path)

    def _run(self) -> None:
        self.write()
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            self.sample()
            if time.monotonic() - last > self.write_every:
                self.write()
                last = time.monotonic()


def shares(before: dict | None, after: dict, thread: str, top: int = 12) -> dict:
    """Between two reports: the thread's busy and idle samples, and its `top` self and total
    functions by share of the busy ones."""
    b = (before or {}).get("threads", {}).get(thread, {})
    a = after.get("threads", {}).get(thread)
    if a is None:
        return dict(samples=0, idle=0, self={}, total={})
    n = a["samples"] - b.get("samples", 0)
    out = dict(samples=n, idle=a["idle"] - b.get("idle", 0))
    for kind in ("self", "total"):
        diff = {k: v - b.get(kind, {}).get(k, 0) for k, v in a[kind].items()}
        out[kind] = {k: round(v / max(n, 1), 4) for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top] if v}
    return out


def from_env() -> HostProfiler | None:
    path = os.environ.get("JAXINFER_HOST_PROFILE")
    return HostProfiler(path).start() if path else None
