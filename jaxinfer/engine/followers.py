"""Several hosts serving one model: process 0 runs the scheduler and the HTTP server, the others follow.

Each process holds an Engine over the same mesh (runner.distributed). Process 0's is wrapped in a `Leader`, which
sends every call that moves the engine (add_request, abort, step, take_finished) to the others before it makes it
(runner.distributed.CommandChannel); each follower makes the same calls in the same order (`follow`). The engine is
deterministic in those calls (request ids, seeds drawn from one shared seed, the scheduler's choices), so every
process launches the same compiled steps in the same order, and their collectives meet. A call is sent before it
is made: process 0's step waits on collectives that the others join only once they have read it.

Failures, one rule: a call that raises on process 0 (a refused request; a step that failed, after which process 0's
server aborts the requests it was running) is followed at once by a note saying so, and the followers' same call
raises alike and is passed over. A call that raised on one side only means the processes no longer hold the same
state: the follower stops with `FollowerDiverged` (process 0, then waiting in a collective that the follower will
not join, cannot recover; the run must be restarted). After `Leader.stop_followers` (process 0's server stopping)
the followers return, and the leader refuses further calls instead of waiting on collectives nobody joins.
"""

from __future__ import annotations

import pickle
import sys
import threading
from typing import TYPE_CHECKING, Any

from jaxinfer.runner.distributed import CommandChannel

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine

CALLS = ("add_request", "abort", "step", "take_finished")   # what changes an engine's state
STOP = "stop"
FAILED = "failed"   # process 0's note: its call (message number) raised
STOP_WAIT_S = 60.0  # how long stop_followers waits for a call in progress (a step) to end first


class FollowerDiverged(RuntimeError):
    """A follower's engine call raised where process 0's did not, or the other way round."""


class Leader:
    """Process 0's engine: the same interface (attributes pass through), its state-changing calls sent first.
    Calls from several threads are sent and made one at a time, in the order they are made."""

    def __init__(self, engine: Engine, channel: CommandChannel | None = None):
        self._engine = engine
        self._channel = channel or CommandChannel()
        self._lock = threading.Lock()
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._engine, name)
        if name not in CALLS:
            return attr

        def sent_then_made(*args, **kwargs):
            with self._lock:
                if self._stopped:
                    raise RuntimeError(f"engine.{name}: the other processes have stopped following (the server "
                                       "stopped)")
                n = self._channel.sent
                self._channel.send(pickle.dumps((name, args, kwargs)))
                try:
                    return attr(*args, **kwargs)
                except Exception:
                    self._channel.send(pickle.dumps((FAILED, (n,), {})))
                    raise

        return sent_then_made

    def stop_followers(self) -> None:
        """Tell the followers to return (once); later engine calls raise. Waits up to STOP_WAIT_S for a call in
        progress to end first (one stuck in a collective is not waited for)."""
        locked = self._lock.acquire(timeout=STOP_WAIT_S)
        try:
            if not self._stopped:
                self._stopped = True
                self._channel.send(pickle.dumps((STOP, (), {})))
        finally:
            if locked:
                self._lock.release()


def follow(engine: Engine, channel: CommandChannel | None = None, note_timeout_s: float = 60.0) -> int:
    """Make process 0's calls on this process's engine until it stops us; returns the calls made. A call that
    raised on process 0 raises here alike and is passed over; one that raised on one side only raises
    FollowerDiverged (after a call that raised here, process 0's note that its own raised is waited for up to
    note_timeout_s). An error of the channel itself (process 0 gone) propagates."""
    channel = channel or CommandChannel()
    n = calls = 0
    failed: tuple[int, str, Exception] | None = None   # this process's last call, where it raised
    while True:
        message = channel.receive(n, note_timeout_s) if failed is not None else channel.receive(n)
        if message is None:
            if failed is not None:
                _diverged(failed, f"process 0 sent nothing within {note_timeout_s:.0f} s after it")
            continue   # process 0 idle: keep waiting
        name, args, kwargs = pickle.loads(message)
        n += 1
        if name == FAILED:
            if failed is None or failed[0] != args[0]:
                raise FollowerDiverged(f"process 0's engine call {args[0]} raised; this process's did not: the "
                                       "processes no longer hold the same engine state")
            if failed[1] != "add_request":   # a refused request is routine; anything else is worth a line
                print(f"[follower: engine call {failed[0]} ({failed[1]}) raised on every process "
                      f"({type(failed[2]).__name__}: {failed[2]}); passed over, as process 0 does]", file=sys.stderr)
            failed = None
            continue
        if failed is not None:
            _diverged(failed, "process 0's did not")
        if name == STOP:
            return calls
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception as e:
            failed = (n - 1, name, e)
        calls += 1


def _diverged(failed: tuple[int, str, Exception], why: str) -> None:
    n, name, error = failed
    raise FollowerDiverged(f"engine call {n} ({name}) raised on this process ({type(error).__name__}: {error}); "
                           f"{why}: the processes no longer hold the same engine state") from error
