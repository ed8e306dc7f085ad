"""What the completion and chat handlers share: server-sent events, waiting for a whole answer
while watching for the client leaving, usage, ids.

A streamed response is an async generator under Starlette's StreamingResponse, which cancels it
when the client disconnects; its `finally` aborts the engine requests, so their pages are freed
before the next step. A non-streamed response watches the connection itself while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.serve.async_engine import EngineDeadError, Event, Group
from jaxinfer.serve.errors import error_body

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_BIG = 20_000   # characters of text input past which tokenizing goes to a worker thread


def _text_size(req: Any) -> int:
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    n = 0
    for m in getattr(req, "messages", None) or ():
        if isinstance(m.content, str):
            n += len(m.content)
        elif m.content:
            n += sum(len(getattr(part, "text", "")) for part in m.content)
    return n


async def off_loop(prepare: Callable, req: Any, info: Any) -> Any:
    """Run `prepare(req, info)` (templating, tokenizing); long inputs in a worker thread so that
    one large prompt does not stall every stream on the event loop."""
    if _text_size(req) < _BIG:
        return prepare(req, info)
    return await asyncio.to_thread(prepare, req, info)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def engine_failed(e: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(e), "internal_error", code="engine_error"), status_code=500)


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(group: Group, request: Request) -> list[Event] | None:
    """Every choice's finishing event (index order), or None if the client left first (then the
    requests are aborted)."""
    finals: dict[int, Event] = {}

    async def consume() -> None:
        async for ev in group.events():
            if ev.delta.finished:
                finals[ev.index] = ev

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()            # raises EngineDeadError if the engine failed
            return [finals[i] for i in range(len(group.requests))]
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        group.abort()


def event_stream(group: Group, body: Callable[[Group], AsyncIterator[bytes]]) -> StreamingResponse:
    """SSE response around `body`; aborts the group however the stream ends."""

    async def gen() -> AsyncIterator[bytes]:
        try:
            async for chunk in body(group):
                yield chunk
        except EngineDeadError as e:
            yield sse(error_body(str(e), "internal_error", code="engine_error"))
            yield DONE
        finally:
            group.abort()    # a no-op once every choice has finished

    return StreamingResponse(gen(), media_type="text/event-stream", headers=SSE_HEADERS)


async def choice_chunks(group: Group, choice_of: Callable[[Event], dict[str, Any] | None],
                        chunk: Callable[..., bytes], include_usage: bool, prompt_tokens: int) -> AsyncIterator[bytes]:
    """The body both endpoints stream: one chunk per event that `choice_of` turns into a choice
    (None: nothing to send), then the usage chunk if asked for, then [DONE]."""
    completion_tokens = 0
    async for ev in group.events():
        completion_tokens += len(ev.delta.token_ids)
        choice = choice_of(ev)
        if choice is not None:
            yield chunk([choice])
    if include_usage:
        yield chunk([], usage(prompt_tokens, completion_tokens))
    yield DONE


def chunk_maker(base: dict[str, Any], include_usage: bool) -> Callable[..., bytes]:
    """chunk(choices, usage=None) -> one SSE event: `base` (id, object, created, model...) plus
    the choices, and a usage field (null until the last chunk) when the client asked for usage."""

    def chunk(choices: list[dict[str, Any]], usage_: dict | None = None) -> bytes:
        obj = {**base, "choices": choices}
        if include_usage:
            obj["usage"] = usage_
        return sse(obj)

    return chunk


async def final_events(group: Group, request: Request) -> list[Event] | Response:
    """collect(), with its two other outcomes already turned into responses."""
    try:
        finals = await collect(group, request)
    except EngineDeadError as e:
        return engine_failed(e)
    return gone() if finals is None else finals


def gone() -> Response:
    """The answer for a client that has already left (nobody reads it)."""
    return Response(status_code=499)
