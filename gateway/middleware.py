"""ASGI middleware: a request id on every response, and a body-size limit enforced while reading.

Pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so streamed responses pass through untouched and
client disconnects still reach the endpoint.

Body limit: a ``Content-Length`` over the limit is answered 413 at once, without reading the body
(uvicorn discards the rest of the upload and keeps the connection usable). A chunked body is counted
as it is read and the request fails with 413 as soon as the count passes the limit, so an oversized
upload is never buffered whole.

Logs: the request id lives in a context variable for the request's task tree (tasks and threads
started while handling it inherit it); ``RequestIdFilter`` copies it into ``record.request_id`` and
``JsonFormatter`` writes one JSON object per line with it, so every log line of a request carries its
id (a filter, not a record factory, because some calls pass ``extra={"request_id": ...}`` themselves).
``gateway.logs.configure_logging`` installs both (``TTS_LOG_FORMAT``, ``TTS_LOG_LEVEL``).
"""

from __future__ import annotations

import contextvars
import json
import logging
import uuid
from datetime import datetime, timezone
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import InvalidRequestError, RequestTooLargeError

log = logging.getLogger("gateway.middleware")

REQUEST_ID_HEADER = b"x-request-id"

#: The id of the request whose task is running (tasks created inside a request inherit it).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` from the running request when the call did not pass one in
    ``extra`` (attach it to a handler to use ``%(request_id)s`` in a format string)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    ``request_id`` (when known) and ``exception`` (the traceback, when there is one).

    Installed by ``gateway.logs.configure_logging``; usable from a uvicorn ``--log-config`` file too:
    ``formatters: {json: {(): gateway.middleware.JsonFormatter}}``.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class BodyTooLarge(RequestTooLargeError):
    """Raised from ``receive`` when a streamed body passes the limit."""


class RequestContextMiddleware:
    """Gives each HTTP request an id (``scope["state"]["request_id"]``, echoed as ``x-request-id``)
    and enforces ``body_limit(path)`` on request bodies."""

    def __init__(self, app: ASGIApp, body_limit: Callable[[str], int]) -> None:
        self.app = app
        self.body_limit = body_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = current_request_id.set(request_id)
        try:
            await self._handle(scope, receive, send, request_id)
        finally:
            current_request_id.reset(token)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, request_id: str) -> None:
        limit = self.body_limit(scope.get("path", ""))
        response_started = False
        body_too_large = False

        async def send_with_id(message: Message) -> None:
            nonlocal response_started
            if body_too_large:
                return  # the app's own answer to the failed read is replaced by our 413
            if message["type"] == "http.response.start":
                response_started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        async def send_error(error: Exception) -> None:
            assert isinstance(error, (RequestTooLargeError, InvalidRequestError))
            response = error.to_response(request_id)
            await response(scope, receive, send)

        content_length = _content_length(scope)
        if content_length == -1:
            await send_error(InvalidRequestError("Invalid Content-Length header.", code="invalid_header"))
            return
        if content_length is not None and content_length > limit:
            log.info("request %s: body of %d bytes refused (limit %d)", request_id, content_length, limit)
            await send_error(RequestTooLargeError(limit))
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received, body_too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    body_too_large = True
                    raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, counting_receive, send_with_id)
        except BodyTooLarge:
            if response_started:
                raise
        if body_too_large and not response_started:
            log.info("request %s: streamed body passed the limit of %d bytes", request_id, limit)
            await send_error(RequestTooLargeError(limit))


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None when absent, -1 when unparseable."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return -1
            return length if length >= 0 else -1
    return None
