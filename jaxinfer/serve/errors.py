"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a fitting status.

Every way a request can go wrong maps to one of these; the exception handlers installed by
`install_handlers` make sure that FastAPI's own errors (a body that is not JSON, a field of the
wrong type, an unknown route) come out in the same shape. Bad input is always a 4xx; a 5xx means
a bug in the server or a failed engine, never the client's fault.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("jaxinfer.serve")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error to answer with: HTTP status, message, the offending parameter and a short code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(APIError(status, message, param, code).body(), status_code=status, headers=headers)


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _loc_to_param(loc: tuple | list) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content", skipping pydantic's union-branch
    tags (a type name such as "str", "list[int]" or "TextPart" is not a field)."""
    out = ""
    for p in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _FIELD.fullmatch(str(p)) and p not in _TYPE_TAGS:
            out += ("." if out else "") + str(p)
    return out or None


def validation_error(exc: RequestValidationError, content_type: str = "application/json") -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    # A union field reports one error per branch; the first names the field well enough.
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request("the request body is not valid JSON: " + str(first.get("ctx", {}).get("error", "")).strip(),
                           code="invalid_json")
    param = _loc_to_param(first.get("loc", ()))
    if first.get("type") == "missing" and param is None:
        return bad_request("the request needs a JSON body", code="missing_body")
    if first.get("type") in ("model_attributes_type", "dict_type") and param is None:
        if "json" not in content_type:
            return bad_request("the request body must be JSON, sent with 'Content-Type: application/json'",
                               code="invalid_content_type")
        return bad_request("the request body must be a JSON object", code="invalid_type")
    msg = first.get("msg", "invalid value")
    if first.get("type") == "value_error":   # raised by a validator of ours: "<param>: what is wrong"
        msg = msg.removeprefix("Value error, ")
        head = msg.split(":", 1)[0]
        if param is None and ":" in msg and " " not in head:
            return bad_request(msg, param=head, code="invalid_value")
    return bad_request(f"{param}: {msg}" if param else msg, param=param,
                       code="missing_required_parameter" if first.get("type") == "missing" else "invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc, request.headers.get("content-type", ""))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", "internal_error"),
                            status_code=500)
