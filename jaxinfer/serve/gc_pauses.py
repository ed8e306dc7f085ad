"""Python's garbage collector in a serving process: time its pauses, and take the start-up heap out of
its scans.

A collection stops every thread that wants the GIL: the engine thread cannot launch the next step
and the event loop cannot stream. A full (generation 2) collection walks every tracked object; after
loading JAX, the model and the server there are ~250k of them (140-200 ms a full collection on the
2-core CI machine). `freeze_heap()` (gc.freeze, as long-running Python servers do after start-up)
moves what start-up allocated to the permanent generation: later collections scan only what serving
allocates. `GCPauses` times each collection through gc.callbacks for a metric.
"""

from __future__ import annotations

import gc
import time
from typing import Callable


def freeze_heap() -> int:
    """Collect once, then freeze what is left (start-up's objects); returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauses:
    """Calls observe(generation, seconds) after every collection while installed."""

    def __init__(self, observe: Callable[[int, float], None]):
        self.observe = observe
        self._start: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.observe(int(info.get("generation", 0)), time.perf_counter() - self._start)
            self._start = None

    def install(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
