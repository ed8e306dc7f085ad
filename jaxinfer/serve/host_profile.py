"""A sampling profiler of the server's Python threads, for finding where host time goes under load.

Set `JAXINFER_HOST_PROFILE=PATH` before `jaxinfer serve`: a daemon thread then reads every thread's
stack (`sys._current_frames()`) every `interval` seconds and, every few seconds, rewrites PATH with
a JSON summary per thread: samples, the innermost functions (self) and every function on the stack
(total) by share of that thread's samples. No dependency and no ptrace (py-spy needs it), so it runs
wherever the server runs. A sample cannot tell running from waiting for the GIL: both show the
line the thread is at.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time


def _where(code) -> str:
    return f"{os.path.basename(code.co_filename)}:{code.co_name}"


class HostProfiler:
    def __init__(self, path: str, interval: float = 0.002, write_every: float = 5.0, top: int = 40):
        self.path, self.interval, self.write_every, self.top = path, interval, write_every, top
        self.samples: collections.Counter = collections.Counter()       # thread name -> samples
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
            self.samples[name] += 1
            self.self_[name][_where(frame.f_code)] += 1
            seen = set()
            while frame is not None:
                w = _where(frame.f_code)
                if w not in seen:
                    seen.add(w)
                    self.total[name][w] += 1
                frame = frame.f_back

    def summary(self) -> dict:
        out = {}
        for name, n in self.samples.most_common():
            out[name] = dict(
                samples=n,
                self={k: round(v / n, 4) for k, v in self.self_[name].most_common(self.top)},
                total={k: round(v / n, 4) for k, v in self.total[name].most_common(self.top)})
        return dict(interval_s=self.interval, threads=out)

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.summary(), f, indent=1)
        os.replace(tmp, self.path)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            self.sample()
            if time.monotonic() - last > self.write_every:
                self.write()
                last = time.monotonic()


def from_env() -> HostProfiler | None:
    path = os.environ.get("JAXINFER_HOST_PROFILE")
    return HostProfiler(path).start() if path else None
