"""Every error the gateway answers has the OpenAI shape `{"error": {"message", "type", "param", "code"}}`.

Bad input is a 4xx whose message says what to fix: validation errors (FastAPI's 422) and malformed JSON
become 400 naming the field; unknown routes 404, wrong methods 405; a feedback event id already
recorded with other content 409; a body over max_request_bytes 413 (`BodyLimitMiddleware`). 503
(overloaded, with Retry-After; or the event store unavailable) and 504 (generation timed out) are the
server's faults. Anything else is a bug: it is logged and answered 500 in the same shape, without
internals.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from realtime_rl.collect import encodable
from realtime_rl.serve.schemas import ApiModel

log = logging.getLogger(__name__)

class ErrorDetail(ApiModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorPublic(ApiModel):
    """The OpenAI error shape, for every 4xx and 5xx."""

    error: ErrorDetail


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error"}


class ApiError(Exception):
    """Raised anywhere in a request; answered by `api_error_handler`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> ErrorPublic:
        return ErrorPublic(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status, headers=err.headers)


# Pydantic puts the tag of a discriminated union in error locations ("messages", 0, "user", "content"),
# ("body", "batch", "events", 3, "event.name"); the client named no such field, so it is left out of `param`.
_MESSAGE_TAGS = {"system", "developer", "user", "assistant", "tool"}
_BODY_TAGS = {"batch", "event"}  # POST /v1/feedback: a batch or one event


def _param(error: Mapping[str, Any]) -> str:
    """("body", "messages", 0, "user", "content") -> "messages[0].content"."""
    loc = list(error.get("loc", ()))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        loc.append(str((error.get("ctx") or {}).get("discriminator", "")).strip("'"))
    if loc and loc[0] == "body":
        loc = loc[2:] if len(loc) > 1 and loc[1] in _BODY_TAGS else loc[1:]
    out, prev = "", None
    for part in loc:
        if not (isinstance(prev, int) and part in _MESSAGE_TAGS):
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        prev = part
    return out


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = list(exc.errors())
    if not errors:
        return ApiError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "decode error")
        return ApiError(400, f"the request body is not valid JSON: {why}", code="invalid_json")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return ApiError(400, "the request needs a JSON body", code="missing_body")
    messages = []
    for e in errors[:5]:
        where, msg = _param(e), str(e.get("msg")).removeprefix("Value error, ")
        msg = msg if len(msg) <= 300 else msg[:300] + "..."  # messages may quote the input
        messages.append(f"{where}: {msg}" if where else msg)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return ApiError(400, "; ".join(messages) + more, param=_param(first) or None, code="invalid_value")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    return error_response(ApiError(exc.status_code, message, headers=exc.headers))


async def unhandled_error_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(ApiError(500, "internal error; the gateway logged it", code="internal_error"))


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before anything parses it: at once when its Content-Length
    says so, else (a chunked body) once the bytes received pass it. FastAPI passes on an HTTPException raised
    while it reads the body, and `http_error_handler` answers it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"the request body exceeds {self.max_bytes} bytes (the gateway's max_request_bytes)"
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await error_response(ApiError(413, message))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise StarletteHTTPException(413, message)
            return msg

        await self.app(scope, counting_receive, send)


def not_unicode(body: bytes) -> str | None:
    """Why a JSON body is not Unicode text, or None. Python's json accepts what is not: an unpaired \\ud800-\\udfff
    escape, and, from bytes, a surrogate's raw UTF-8 bytes (ED A0 80: it decodes with surrogatepass) or UTF-16/32.
    The stores (and UTF-8 output) refused such text only once the model had answered; a stop string of it killed
    the engine's thread. Bodies without a \\u escape hold no escaped surrogate and are not parsed here."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the request body is not UTF-8 text ({exc.reason} at byte {exc.start}); JSON bodies are UTF-8"
    if b"\\u" not in body:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the stack: the route's own parse answers it
        return None
    if not encodable(json.dumps(value, ensure_ascii=False)):
        return ("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which "
                "is not Unicode text")
    return None


class UnicodeBodyRoute(APIRoute):
    """A route whose JSON body must be Unicode text throughout: a body that is not UTF-8, or a lone surrogate
    anywhere in it, is a 400 before the handler runs (the body is read once; the handler's parse reuses it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if (why := not_unicode(await request.body())) is not None:
                raise ApiError(400, why, code="invalid_value")
            return await handler(request)

        return checked


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unhandled_error_handler)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorPublic, "description": why} for status, why in [
        (400, "Bad input: the message names the field to fix"), (401, "No valid bearer key"),
        (403, "The key lacks the scope"), (404, "Unknown model"), (413, "The body exceeds max_request_bytes"),
        (503, "Overloaded (Retry-After) or the event store is unavailable"), (504, "Generation timed out"),
    ]
}
