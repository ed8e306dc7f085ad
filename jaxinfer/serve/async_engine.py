"""The engine behind an event loop: one background thread owns the (synchronous) Engine.

The HTTP handlers never touch the Engine. They hand work to its thread through one FIFO command
queue (add, abort) and receive what each step produced through an asyncio queue per HTTP request,
filled with one `call_soon_threadsafe` per step and event loop (not one per token). The thread:

    loop: take the commands that arrived (block while there is no work) -> add / abort
          -> wait for newcomers until the decode dispatch in flight nears its end
          -> engine.step() -> route the deltas (and, for finished requests, their outputs)

The wait keeps a request that arrives during a decode dispatch from also waiting for the next
one: the engine chains dispatches (launches N+1 before reading N back) only while nobody waits
to join. A newcomer that arrives while N runs wakes the thread at once; it lets N finish, takes
the newcomer, and the next step is its prefill (with `Engine.prefills_behind_decode` it takes the
newcomer at once and the engine launches the prefill behind N before reading N back). If nobody
comes by N's expected end less the
time a launch takes (`Engine.chain_at`, measured), the thread steps: N+1 is launched as N ends,
so the device does not sit idle for the launch (about a decode step's time). Skipped when the
batch has no free slot (nobody could join).

Because commands are handled in order, an abort always finds the request its add created, and
an abort frees the request's pages before the next step runs. The waiting queue is bounded:
`submit` refuses (503) when more than `max_waiting` requests would wait for one of the engine's
`max_num_seqs` running slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator

from jaxinfer.engine.dispatch_timing import POLL
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams
from jaxinfer.serve.errors import APIError

log = logging.getLogger("jaxinfer.serve")
_PARAMS = {f.name for f in dataclasses.fields(SamplingParams)} | {"prompt"}


THREAD_PHASES = ("commands", "wait", "deliver")


class EngineDeadError(RuntimeError):
    pass


@dataclasses.dataclass
class Event:
    """What one step produced for choice `index` of a group."""

    index: int
    delta: Any                 # engine StreamDelta
    output: Any = None         # engine RequestOutput, on the finishing event


@dataclasses.dataclass(eq=False)
class _Request:
    group: Group
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    rid: int | None = None     # the engine's id, once added
    done: bool = False
    # timing (perf_counter, one clock for both threads): taken into the engine and first token id
    # produced, on the engine thread; first and last token seen, on the event loop
    added_at: float | None = None
    first_token_engine_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    added_step: int = 0        # the engine thread's step count when this request was taken in
    steps_to_first: int = 0    # engine steps from being taken in to the first token id


class Group:
    """The engine requests of one HTTP request (n choices x prompts) and their event queue."""

    def __init__(self, owner: AsyncEngine, loop: asyncio.AbstractEventLoop, arrived: float | None = None):
        self.owner = owner
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[_Request] = []
        self.arrived = arrived if arrived is not None else time.perf_counter()
        self.added: asyncio.Future = loop.create_future()
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(r.done for r in self.requests)

    async def events(self) -> AsyncIterator[Event]:
        """Events in the order the engine produced them, until every choice has finished."""
        left = sum(not r.done for r in self.requests)
        while left:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            req = self.requests[item.index]
            self.owner._observe(req, item)
            if item.delta.finished:
                req.done = True
                left -= 1
            yield item

    def abort(self, client_gone: bool = True) -> None:
        """Cancel every choice still running (safe to call more than once, from the event loop)."""
        if self._closed:
            return
        self._closed = True
        live = [r for r in self.requests if not r.done]
        for r in live:
            r.done = True
        if live:
            self.owner._abort(live)
            if self.owner.metrics and client_gone:
                self.owner.metrics.aborted.inc(len(live))


class AsyncEngine:
    def __init__(self, engine, max_waiting: int = 256, metrics=None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.slots = engine.config.max_num_seqs   # running batch size
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0                    # adds queued, not yet in the engine
        self._live: dict[int, _Request] = {}  # engine id -> request (engine thread only)
        self._busy = 0.0                     # seconds the engine thread spent working
        self._steps = 0                      # engine steps run (engine thread only)
        self._since: float | None = None     # start of the work in progress
        # The thread's own phases beside the engine's (Engine.phase_seconds): commands (adding and
        # aborting requests), wait (for newcomers before a step, commands arriving then included),
        # deliver (routing a step's deltas to the event loops, publishing the snapshot).
        self._phases = dict.fromkeys(THREAD_PHASES, 0.0)
        self.snapshot: dict[str, float] = {}
        self._publish()
        self.error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     arrived: float | None = None) -> Group:
        """Queue one engine request per (prompt ids, params) pair; return once the engine took them all.

        `arrived` (perf_counter) is when the HTTP request came in: latencies are measured from it.

        Raises APIError: 503 when the waiting queue is full or the engine is down, 400 when the
        engine refuses a request (then the others of the group are aborted).
        """
        if not self.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        limit = self.slots + self.max_waiting
        if len(prompts) > limit:
            raise APIError(400, f"this request needs {len(prompts)} sequences (prompts x n); the server holds at "
                           f"most {limit}", param="n", code="too_many_sequences")
        loop = asyncio.get_running_loop()
        group = Group(self, loop, arrived)
        with self._lock:
            in_system = self._pending + int(self.snapshot["waiting"]) + int(self.snapshot["running"])
            if in_system + len(prompts) > limit:
                waiting = max(in_system - self.slots, 0)
                if self.metrics:
                    self.metrics.rejected.inc()
                raise APIError(503, f"the server is overloaded ({waiting} requests waiting); retry later",
                               code="server_overloaded")
            self._pending += len(prompts)
        group.requests = [_Request(group, i, ids, p) for i, (ids, p) in enumerate(zip(prompts, params))]
        self._commands.put(("add", group))
        if self.metrics:
            self.metrics.on_submit(sum(len(p) for p in prompts))
        try:
            await asyncio.shield(group.added)
        except asyncio.CancelledError:
            group.abort()
            raise
        except BaseException:           # the engine refused the group (it has undone its part)
            group.abort(client_gone=False)
            raise
        return group

    def _abort(self, reqs: list[_Request]) -> None:
        self._commands.put(("abort", reqs))

    def _observe(self, req: _Request, ev: Event) -> None:
        """Per-request timing on the event loop, where the client sees it."""
        n = len(ev.delta.token_ids)
        if n:
            now = time.perf_counter()
            if req.first_token_at is None:
                req.first_token_at = now
                if self.metrics:
                    self.metrics.on_first_token(req.group.arrived, req.added_at, req.first_token_engine_at, now,
                                            req.steps_to_first)
            req.last_token_at = now
            req.num_tokens += n
            if self.metrics:
                self.metrics.generation_tokens.inc(n)
        if ev.delta.finished and self.metrics:
            self.metrics.on_finish(req.group.arrived, req.first_token_at, req.last_token_at, req.num_tokens,
                                   ev.delta.finish_reason)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _publish(self) -> None:
        e = self.engine
        pages = e.pages
        self.snapshot = {
            "running": e.num_running, "waiting": e.num_waiting, "pages_in_use": pages.num_in_use,
            "pages_total": pages.capacity, "prefix_cache_hit_rate": e.prefix_cache_hit_rate,
            # where the engine thread's time goes: working (a step, adding and aborting requests),
            # and within that, blocked on the device; the rest of busy is host work
            "engine_busy_seconds": self._busy + (time.perf_counter() - self._since if self._since else 0.0),
            "engine_device_wait_seconds": e.runner.device_wait_seconds,
            "structured_mask_seconds": e.constraints.mask_seconds, "structured_masks": e.constraints.masks,
            "phases": {**e.phase_seconds, **self._phases},
        }
        if e.speculator is not None:
            spec = e.speculator.stats
            self.snapshot.update(spec_drafted=spec.drafted, spec_accepted=spec.accepted,
                                 spec_mean_accepted_length=spec.mean_accepted_length)

    def _run(self) -> None:
        try:
            while not self._stop:
                cmds = self._take_commands(block=not self.engine.has_unfinished())
                self._since = time.perf_counter()
                self._handle(cmds)
                self._phases["commands"] += time.perf_counter() - self._since
                if self._stop:
                    break
                if self.engine.has_unfinished():
                    try:
                        if self.engine.num_running < self.slots:
                            t0 = time.perf_counter()
                            self._wait_for_newcomers()
                            self._phases["wait"] += time.perf_counter() - t0
                        self._step()
                    except Exception as e:  # a bug hit by some request: fail those running, keep serving
                        log.exception("engine step failed; aborting the %d live requests", len(self._live))
                        self._fail_all(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"), abort=True)
                self._busy += time.perf_counter() - self._since
                self._since = None
        except BaseException as e:  # the engine cannot go on: fail everyone, refuse new work (503)
            log.exception("the engine thread died")
            self.error = e
            self._stop = True
            self._fail_all(EngineDeadError(f"the engine failed: {type(e).__name__}: {e}"), abort=False)

    def _wait_for_newcomers(self) -> None:
        """Block on the command queue until the dispatch in flight is due to be chained; a command
        that arrives first ends the wait: then the dispatch is let finish and the commands handled;
        with `Engine.prefills_behind_decode` a newcomer is taken in at once instead (its prompt step is
        launched behind the dispatch, the host's work for it done while the dispatch runs)."""
        behind = self.engine.prefills_behind_decode
        at = self.engine.chain_at()
        if at is None:            # nothing in flight, or its batch size not yet timed: as a newcomer would
            if not behind:
                self.engine.wait()
            self._handle(self._take_commands(block=False))
            return
        cmds = []
        t0 = time.perf_counter()
        # In slices of POLL: a dispatch that ends before it was due (the estimate is only an
        # estimate; a first one may include a pause) is chained at once and timed from what was seen.
        while (timeout := at - time.perf_counter()) > 0:
            try:
                cmds.append(self._commands.get(timeout=min(timeout, POLL)))
                break
            except queue.Empty:
                if self.engine.inflight_done():
                    break
        self.engine.runner.device_wait_seconds += time.perf_counter() - t0   # the device was working
        cmds += self._take_commands(block=False)
        if cmds:
            if not behind:
                self.engine.wait()
            self._handle(cmds + self._take_commands(block=False))

    def _take_commands(self, block: bool) -> list[tuple[str, Any]]:
        cmds = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmds: list[tuple[str, Any]]) -> None:
        if not cmds:
            return
        settled: list[tuple[Group, BaseException | None]] = []
        n_added = 0
        for kind, arg in cmds:
            if kind == "add":             # a whole group at once: all its requests are added, or none
                g: Group = arg
                n_added += len(g.requests)
                if g._closed:
                    continue              # its client left before it got here
                settled.append((g, self._add_group(g)))
            elif kind == "abort":
                for req in arg:
                    if req.rid is not None and self._live.pop(req.rid, None) is not None:
                        self.engine.abort(req.rid)
        with self._lock:
            self._pending -= n_added
            self._publish()
        for g, err in settled:
            g.loop.call_soon_threadsafe(_settle, g.added, err)

    def _add_group(self, g: Group) -> BaseException | None:
        for req in g.requests:
            try:
                req.added_at = time.perf_counter()
                req.added_step = self._steps
                req.rid = self.engine.add_request(req.prompt_ids, req.params)
                self._live[req.rid] = req
                continue
            except (JaxinferError, ValueError) as e:
                field = str(e).split(":", 1)[0].split(" ", 1)[0]
                err: BaseException = APIError(400, str(e), param=field if field in _PARAMS else None,
                                              code="invalid_request")
            except Exception as e:
                log.exception("engine.add_request failed")
                err = APIError(500, f"the engine could not take the request: {type(e).__name__}",
                               code="internal_error")
            for r in g.requests:          # undo the siblings already added
                if r.rid is not None and self._live.pop(r.rid, None) is not None:
                    self.engine.abort(r.rid)
            return err
        return None

    def _step(self) -> None:
        deltas = self.engine.step()
        now = time.perf_counter()
        self._steps += 1
        if self.engine.mixed_step_times:
            if self.metrics:
                for bucket, seconds in self.engine.mixed_step_times:
                    self.metrics.mixed_step(bucket, seconds)
            self.engine.mixed_step_times.clear()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}
        for d in deltas:
            req = self._live.get(d.request_id)
            if req is None:
                continue
            if req.first_token_engine_at is None and d.token_ids:
                req.first_token_engine_at = now
                req.steps_to_first = self._steps - req.added_step
            out = None
            if d.finished:
                del self._live[d.request_id]
                out = self.engine.take_finished(d.request_id)
            by_loop.setdefault(req.group.loop, []).append((req.group.queue, Event(req.index, d, out)))
        self._phases["deliver"] += time.perf_counter() - now   # (published with the time so far)
        with self._lock:
            self._publish()
        t0 = time.perf_counter()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:   # that loop is closed (its server stopped): nobody is listening
                pass
        self._phases["deliver"] += time.perf_counter() - t0

    def _fail_all(self, err: BaseException, abort: bool) -> None:
        for rid, req in list(self._live.items()):
            if abort:
                self.engine.abort(rid)
            try:
                req.group.loop.call_soon_threadsafe(req.group.queue.put_nowait, err)
            except RuntimeError:
                pass
        self._live.clear()
        with self._lock:
            self._publish()


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


def _settle(fut: asyncio.Future, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(None)
    else:
        fut.set_exception(err)
