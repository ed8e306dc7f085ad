"""Device traces of a running server, for finding where its device time goes under load (a developer tool).

Set `JAXINFER_DEVICE_TRACE=DIR` before `jaxinfer serve`: the app then has two more routes,
`POST /debug/device_trace/start?name=NAME` and `POST /debug/device_trace/stop`, which run jax.profiler over
the whole process between the two calls and write the trace under DIR/NAME (perfetto JSON). Without the
variable the routes do not exist. `bench/serving.py --device-trace DIR` brackets each request rate with
them and prints the device's busy share and its idle gaps (bench/trace_kernels.py): what the engine
thread's wall-clock view cannot tell apart (a slow step on the device, or a device waiting for the host).
XLA switches CUDA-graph command buffers off while a profiler runs unless XLA_FLAGS has
--xla_enable_command_buffers_during_profiling=true when the server starts (bench/serving.py sets it).
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from pathlib import Path

from fastapi import FastAPI

from jaxinfer.serve.errors import APIError

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class DeviceTracer:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.active: Path | None = None
        self._lock = threading.Lock()

    def start(self, name: str) -> Path:
        import jax

        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise APIError(400, f"name must be 1-64 of [A-Za-z0-9_.-], got {name!r}", param="name")
        with self._lock:
            if self.active is not None:
                raise APIError(409, f"a trace is already running ({self.active.name})", code="trace_running")
            path = self.root / name
            jax.profiler.start_trace(str(path), create_perfetto_trace=True)
            self.active = path
            return path

    def stop(self) -> Path:
        import jax

        with self._lock:
            if self.active is None:
                raise APIError(409, "no trace is running", code="no_trace")
            path, self.active = self.active, None
            jax.profiler.stop_trace()
            return path


def from_env() -> DeviceTracer | None:
    root = os.environ.get("JAXINFER_DEVICE_TRACE")
    return DeviceTracer(root) if root else None


def install(app: FastAPI, tracer: DeviceTracer) -> None:
    """The start/stop routes (left out of the OpenAPI schema: not part of the API)."""

    @app.post("/debug/device_trace/start", include_in_schema=False)
    async def start(name: str) -> dict[str, str]:
        return {"dir": str(await asyncio.to_thread(tracer.start, name))}

    @app.post("/debug/device_trace/stop", include_in_schema=False)
    async def stop() -> dict[str, str]:
        return {"dir": str(await asyncio.to_thread(tracer.stop))}
