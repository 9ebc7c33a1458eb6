"""Errors in OpenAI's envelope, on every error path.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` (all four keys) with a JSON
content type. FastAPI/Starlette's own answers (404 route, 405 method, 422 validation, 500) are
replaced by ``install_error_handlers`` so that no ``{"detail": ...}`` and no 422 ever leaves.

Retry semantics matter because the OpenAI SDK retries 408/409/429/5xx by itself: a client mistake
gets a 4xx with ``x-should-retry: false``; overload gets 429/503 with ``Retry-After`` (and
``retry-after-ms``, which the SDK prefers).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

log = logging.getLogger("gateway.errors")

#: Statuses the OpenAI SDK retries by default; a client error is never answered with one of these.
SDK_RETRIED_STATUSES = frozenset({408, 409, 429})


class APIError(Exception):
    """An error the client should see, in OpenAI's shape.

    ``type`` defaults to ``invalid_request_error`` for 4xx and ``server_error`` for 5xx.
    ``retry_after`` (seconds) becomes ``Retry-After``/``retry-after-ms``; 429/503 default to 1 s.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")
        self.code = code
        self.param = param
        # Overload answers always say when to come back (the SDK honours it).
        self.retry_after = retry_after if retry_after is not None or status not in (429, 503) else 1.0
        self.extra_headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if 400 <= self.status < 500 and self.status not in SDK_RETRIED_STATUSES:
            headers["x-should-retry"] = "false"
        if self.retry_after is not None:
            headers["retry-after"] = str(max(0, math.ceil(self.retry_after)))
            headers["retry-after-ms"] = str(max(0, round(self.retry_after * 1000)))
        headers.update(self.extra_headers)
        return headers

    def to_response(self, request_id: str | None = None) -> JSONResponse:
        headers = self.headers()
        if request_id:
            headers["x-request-id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.message!r}, code={self.code!r}, param={self.param!r})"


class InvalidRequestError(APIError):
    """400: the request is malformed or a field is invalid."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "invalid_value") -> None:
        super().__init__(400, message, param=param, code=code)


class NotFoundError(APIError):
    """404: the named thing (route, model, voice ...) does not exist."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = "not_found") -> None:
        super().__init__(404, message, param=param, code=code)


class ModelNotFoundError(NotFoundError):
    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class RequestTooLargeError(APIError):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            413,
            f"The request body is too large; the limit is {limit_bytes} bytes.",
            code="request_too_large",
        )


class RateLimitedError(APIError):
    """429: too many requests right now; the SDK retries after ``retry_after``."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(429, message, code="rate_limit_exceeded", retry_after=retry_after)


class ServiceUnavailableError(APIError):
    """503: a backend is down or overloaded; the SDK retries after ``retry_after``."""

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str = "service_unavailable") -> None:
        super().__init__(503, message, code=code, retry_after=retry_after)


def request_id_of(request: Request) -> str | None:
    """The id ``gateway.middleware`` gave this request (None outside the middleware, e.g. unit tests)."""
    return request.scope.get("state", {}).get("request_id")


# --- pydantic validation errors → one APIError ------------------------------------------------------

_TYPE_NAMES = {
    "string_type": "a string",
    "float_type": "a number",
    "int_type": "an integer",
    "bool_type": "a boolean",
    "dict_type": "an object",
    "model_type": "an object",
    "list_type": "an array",
    "finite_number": "a finite number",
}


def json_type_name(value: Any) -> str:
    """How OpenAI's error messages name a JSON value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def validation_error_to_api_error(errors: list[dict[str, Any]], *, skip_loc_prefix: tuple[str, ...] = ()) -> APIError:
    """Turn the first pydantic error into a 400 naming the offending field in ``param``.

    Custom errors raised by ``gateway.schemas`` carry their OpenAI-style code as the pydantic error
    type and a finished message; pydantic's built-in types are mapped here.
    """
    if not errors:
        return InvalidRequestError("Invalid request.")
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part not in skip_loc_prefix]
    param = ".".join(loc) or None
    kind = error.get("type", "")
    value = error.get("input")
    if kind == "missing":
        return InvalidRequestError(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    if kind in _TYPE_NAMES:
        return InvalidRequestError(
            f"Invalid type for '{param}': expected {_TYPE_NAMES[kind]}, but got {json_type_name(value)} instead.",
            param=param,
            code="invalid_type",
        )
    ctx = error.get("ctx") or {}
    if kind in {"string_above_max_length", "string_below_min_length", "empty_string", "invalid_value",
                "decimal_above_max_value", "decimal_below_min_value", "invalid_type"}:
        # Raised by our own validators with a finished message.
        return InvalidRequestError(error.get("msg", "Invalid value."), param=param, code=kind)
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        return InvalidRequestError(
            f"Invalid value: {value!r}. Supported values are: {expected}.", param=param, code="invalid_value"
        )
    return InvalidRequestError(f"Invalid value for '{param}': {error.get('msg', 'invalid')}.", param=param)


# --- handlers ------------------------------------------------------------------------------------


async def _handle_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        log.warning("request %s failed: %r", request_id_of(request), exc)
    return exc.to_response(request_id_of(request))


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no route) / 405 (wrong method) and any HTTPException raised by a route."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        error = NotFoundError(f"Invalid URL ({request.method} {request.url.path})", code="not_found")
    elif status == 405:
        error = APIError(
            405,
            f"Method {request.method} is not allowed for {request.url.path}.",
            code="method_not_allowed",
            headers=dict(exc.headers or {}),  # keeps Starlette's Allow header
        )
    else:
        detail = exc.detail if isinstance(exc.detail, str) else "Request failed."
        error = APIError(status, detail, headers=dict(exc.headers or {}))
    return error.to_response(request_id_of(request))


async def _handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's parameter/body validation (422 by default) becomes a 400 envelope."""
    assert isinstance(exc, RequestValidationError)
    error = validation_error_to_api_error(list(exc.errors()), skip_loc_prefix=("body", "query", "path", "header", "form"))
    return error.to_response(request_id_of(request))


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything unhandled: a 500 envelope (the traceback is logged by the server)."""
    log.error("unhandled error in request %s: %r", request_id_of(request), exc)
    error = APIError(500, "The server had an error while processing your request.", code="internal_error")
    return error.to_response(request_id_of(request))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _handle_api_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    app.add_exception_handler(Exception, _handle_unexpected)
