"""Several hosts serving one model: process 0 runs the scheduler and the HTTP server, the others follow.

Each process holds an Engine over the same mesh (runner.distributed). Process 0's is wrapped in a `Leader`, which
sends every call that moves the engine (add_request, abort, step, take_finished) to the others before it makes it
(runner.distributed.CommandChannel); each follower makes the same calls in the same order (`follow`). The engine is
deterministic in those calls (request ids, seeds drawn from one shared seed, the scheduler's choices), so every
process launches the same compiled steps in the same order, and their collectives meet. A call is sent before it
is made: process 0's step waits on collectives that the others join only once they have read it.
"""

from __future__ import annotations

import pickle
from typing import Any

from jaxinfer.errors import JaxinferError
from jaxinfer.runner.distributed import CommandChannel

CALLS = ("add_request", "abort", "step", "take_finished")   # what changes an engine's state
STOP = "stop"


class Leader:
    """Process 0's engine: the same interface (attributes pass through), its state-changing calls sent first."""

    def __init__(self, engine, channel: CommandChannel | None = None):
        self._engine = engine
        self._channel = channel or CommandChannel()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in CALLS:
            return attr

        def sent_then_made(*args, **kwargs):
            self._channel.send(pickle.dumps((name, args, kwargs)))
            return attr(*args, **kwargs)

        return sent_then_made

    def stop_followers(self) -> None:
        self._channel.send(pickle.dumps((STOP, (), {})))


def follow(engine, channel: CommandChannel | None = None) -> int:
    """Make process 0's calls on this process's engine until it stops us; returns the calls made. A call that
    failed on process 0 (a request it refused) fails here alike and is passed over."""
    channel = channel or CommandChannel()
    n = 0
    while True:
        message = channel.receive(n)
        if message is None:   # process 0 idle: keep waiting
            continue
        name, args, kwargs = pickle.loads(message)
        if name == STOP:
            return n
        try:
            getattr(engine, name)(*args, **kwargs)
        except (JaxinferError, ValueError, KeyError):
            if name == "step":
                raise
        n += 1
