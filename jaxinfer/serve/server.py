"""Run the app under uvicorn: `serve()` for the CLI, `ServerThread` for tests and benchmarks."""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
import threading
import time

import uvicorn

from jaxinfer.serve.app import create_app
from jaxinfer.serve.gc_pauses import freeze_heap


def engine_options(max_num_seqs: int | None = None, max_model_len: int | None = None,
                   gpu_memory_fraction: float | None = None, **other) -> dict:
    """Engine keyword arguments, leaving out what the engine does not know (yet)."""
    from jaxinfer.engine.engine import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    opts = {k: v for k, v in dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  gpu_memory_fraction=gpu_memory_fraction, **other).items() if v is not None}
    dropped = sorted(set(opts) - fields)
    if dropped:
        print(f"[jaxinfer serve: this engine has no option {', '.join(dropped)}; ignored]", file=sys.stderr)
    return {k: v for k, v in opts.items() if k in fields}


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, max_waiting: int = 256, log_level: str = "info",
          freeze_gc: bool = True, **engine_kwargs) -> None:
    from jaxinfer.engine.engine import Engine

    engine = Engine(model, **engine_options(**engine_kwargs))
    app = create_app(engine, served_model_name=served_model_name, api_key=api_key, max_waiting=max_waiting)
    if freeze_gc:   # start-up's objects out of every later collection's scan (gc_pauses.py)
        freeze_heap()
    name = served_model_name or engine.model_dir.name
    print(f"[serving '{name}' on http://{host}:{port}/v1 (max_model_len {engine.max_model_len}, "
          f"max_num_seqs {engine.config.max_num_seqs}, waiting queue {max_waiting}"
          f"{', API key required' if api_key else ''})]", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                timeout_graceful_shutdown=5)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """The app under uvicorn in a background thread of this process (tests, benchmarks)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host, self.port = host, port or free_port(host)
        self.app = app
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


logging.getLogger("jaxinfer.serve").addHandler(logging.NullHandler())
