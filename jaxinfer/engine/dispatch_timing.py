"""When to launch the next decode dispatch: running estimates of a dispatch's device time and of the
host's launch time. A launch holds the host for about a millisecond, so a server that waits for each
dispatch to end before launching the next idles the device for it; `Engine.chain_at` says when to stop
waiting for newcomers instead."""

from __future__ import annotations

import collections
import time

POLL = 0.001   # seconds between looks at the running decode dispatch while waiting for newcomers


class DispatchTiming:
    """Estimates of how long a decode dispatch runs on the device (per batch bucket) and how long the
    host takes to launch one, for `Engine.chain_at`.

    A dispatch's end is seen only when the host next looks (a read-back or a wait), which is after it
    launched the successor, so every observed duration is an upper bound, and one that grows with a
    late launch: an average would feed on itself (chain later, observe longer, chain later still).
    The estimate is the least of the last `window` observations."""

    def __init__(self, window: int = 8, weight: float = 0.3):
        self.window, self.weight = window, weight
        self.launch = 0.0
        self.observed: dict[int, collections.deque] = {}
        self.start: float | None = None      # when the dispatch in flight began running on the device
        self.end: float | None = None        # when the host first saw it finished

    def launched(self, seconds: float) -> None:
        self.launch = seconds if not self.launch else self.launch + self.weight * (seconds - self.launch)

    def started(self, at: float | None = None) -> None:
        now = time.perf_counter()
        self.start, self.end = (now if at is None else min(at, now)), None

    def expected_end(self, bucket: int) -> float | None:
        d = self.duration(bucket)
        return None if d is None or self.start is None else self.start + d

    def finished(self) -> None:
        if self.end is None:
            self.end = time.perf_counter()

    def record(self, bucket: int) -> None:
        if self.start is None or self.end is None:
            return
        self.observed.setdefault(bucket, collections.deque(maxlen=self.window)).append(self.end - self.start)
        self.start = None

    def duration(self, bucket: int) -> float | None:
        seen = self.observed.get(bucket)
        return min(seen) if seen else None

    def chain_at(self, bucket: int, early: float = 0.0) -> float | None:
        """When to launch the successor: the expected end less the launch time and `early` seconds."""
        end = self.expected_end(bucket)
        return None if end is None else end - self.launch - early
