"""The FastAPI app: routes of the OpenAI API plus /health and /metrics.

`create_app(engine, ...)` puts an AsyncEngine (the engine's own thread) behind the routes. The
handlers live in completions.py and chat.py; request models in protocol.py; errors in errors.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from jaxinfer.serve import device_trace, host_profile
from jaxinfer.serve.async_engine import AsyncEngine
from jaxinfer.serve.auth import APIKeyMiddleware
from jaxinfer.serve.chat import create_chat_completion
from jaxinfer.serve.completions import create_completion
from jaxinfer.serve.errors import APIError, install_handlers
from jaxinfer.serve.gc_pauses import GCPauses
from jaxinfer.serve.logprobs import TokenText
from jaxinfer.serve.metrics import CONTENT_TYPE, Metrics, StampReceived, probe_loop_lag
from jaxinfer.serve.params import ModelInfo
from jaxinfer.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from jaxinfer.serve.state import ServerState
from jaxinfer.text import ChatTemplate, load_chat_template

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model"},
    503: {"model": ErrorResponse, "description": "overloaded: the waiting queue is full"},
}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events, ending in "
                                         "'data: [DONE]'"}}}


def create_app(engine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_waiting: int = 256, chat_template: str | os.PathLike[str] | None = None) -> FastAPI:
    """An app serving `engine` (a jaxinfer Engine, which the app's AsyncEngine thread then owns).

    `chat_template` (a Jinja file's path or the template text) replaces the model's own for
    /v1/chat/completions; a model with neither answers chat requests 400. A template that cannot be
    read or does not compile raises ChatTemplateError (a ValueError) here, before anything starts."""
    if engine.tokenizer is None:
        raise ValueError("the server needs the model's tokenizer (skip_tokenizer_init=False)")
    tok = engine.tokenizer
    if chat_template is not None:
        chat = ChatTemplate(load_chat_template(chat_template), tok.special_tokens_map, source="the server's chat template")
    else:
        chat = tok.chat if tok.chat.templates else None
    name = served_model_name or engine.model_dir.name
    info = ModelInfo(name=name, root=str(engine.model_dir), tokenizer=engine.tokenizer,
                     vocab_size=engine.cfg.vocab_size, max_model_len=engine.max_model_len,
                     max_logprobs=engine.config.max_logprobs,
                     prompt_logprobs=engine.config.enable_prompt_logprobs,
                     sampling_defaults=dict(engine.sampling_defaults), chat=chat,
                     check_structured=engine.constraints.check)
    metrics = Metrics(name)
    driver = AsyncEngine(engine, max_waiting=max_waiting, metrics=metrics)
    metrics.bind(driver)
    state = ServerState(info, driver, metrics, TokenText(engine.tokenizer), int(time.time()))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        profiler = host_profile.from_env()    # JAXINFER_HOST_PROFILE=PATH: sample the threads' stacks
        lag = asyncio.ensure_future(probe_loop_lag(metrics.loop_lag.observe))
        pauses = GCPauses(metrics.gc_pause).install()
        yield
        pauses.remove()
        lag.cancel()
        driver.shutdown()
        if profiler:
            profiler.stop()

    app = FastAPI(title="jaxinfer", description="OpenAI-compatible server in front of the jaxinfer engine",
                  version="0.1.0", lifespan=lifespan)
    app.state.jaxinfer = state
    install_handlers(app)

    def card() -> dict[str, Any]:
        return ModelCard(id=name, created=state.created, root=info.root, max_model_len=info.max_model_len).model_dump()

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not driver.alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={k: _ERRORS[k] for k in (401, 404)})
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return card()

    @app.post("/v1/completions", response_model=None,
              responses={200: {"model": CompletionResponse, "content": _SSE}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, state)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, state)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, less its 422 entries: validation errors are answered with 400 here."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for key in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(key, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if (tracer := device_trace.from_env()) is not None:   # JAXINFER_DEVICE_TRACE=DIR: /debug/device_trace/*
        device_trace.install(app, tracer)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(StampReceived)   # outermost: the stamp is taken first
    return app
