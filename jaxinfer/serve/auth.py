"""API-key check as plain ASGI middleware: every path but /health needs `Authorization: Bearer KEY`.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so that streamed responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json

from jaxinfer.serve.errors import error_body

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            return await self.app(scope, receive, send)
        message = "missing API key: send the header 'Authorization: Bearer <key>'" if not given else \
            "incorrect API key"
        body = json.dumps(error_body(message, "invalid_request_error", None, "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
