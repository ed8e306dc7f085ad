"""Run the app under uvicorn: `serve()` for the CLI, `ServerThread` for tests and benchmarks."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from pathlib import Path

import jax
import uvicorn

from jaxinfer.serve.app import create_app
from jaxinfer.engine.followers import Leader, follow
from jaxinfer.serve.gc_pauses import freeze_heap
from jaxinfer.settings import ServerConfig


def serve(model: str, server: ServerConfig | None = None, **engine_settings) -> None:
    """Load `model` with the engine settings (EngineConfig's fields), compile every step, serve until stopped."""
    from jaxinfer.engine.engine import Engine

    server = server or ServerConfig()
    check_port_free(server.host, server.port)   # before minutes of loading and compiling
    chat_template = Path(server.chat_template).read_text() if server.chat_template else None
    engine = Engine(model, **{"compile_all_at_start": True, **engine_settings})
    print(engine.summary, file=sys.stderr)
    if jax.process_count() > 1:   # several hosts: process 0 serves, the others make its engine calls after it
        if jax.process_index() > 0:
            print(f"[process {jax.process_index()}: following process 0's engine]", file=sys.stderr)
            follow(engine)
            return
        engine = Leader(engine)
    app = create_app(engine, served_model_name=server.served_model_name, api_key=server.api_key,
                     max_waiting=server.max_waiting, chat_template=chat_template)
    if server.freeze_gc:   # start-up's objects out of every later collection's scan (gc_pauses.py)
        freeze_heap()
    name = server.served_model_name or engine.model_dir.name
    print(f"[serving '{name}' on http://{server.host}:{server.port}/v1 (max_model_len {engine.max_model_len}, "
          f"max_num_seqs {engine.config.max_num_seqs}, waiting queue {server.max_waiting}"
          f"{', API key required' if server.api_key else ''})]", file=sys.stderr)
    try:
        uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level,
                    access_log=server.log_level == "debug", timeout_graceful_shutdown=5)
    finally:
        if isinstance(engine, Leader):
            engine.stop_followers()


def check_port_free(host: str, port: int) -> None:
    """Raise OSError naming the address when uvicorn could not bind (host, port): a busy port, an
    address not on this machine. Binds as uvicorn does (SO_REUSEADDR, so a port in TIME_WAIT is free)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        error = OSError(f"cannot serve on {host}:{port}: {e.strerror or e}")   # one line, no "[Errno n]"
        error.errno = e.errno
        raise error from e


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
