"""Typed failures of the speech-token LLM server, so the gateway can map each to its own HTTP status.

Suggested mapping (the gateway decides): LLMUnavailable -> 503, LLMTimeout -> 504,
LLMBadRequest -> 500 (we built the request: a 4xx upstream is our bug or a misconfiguration,
e.g. a wrong model name, not the caller's), LLMServerError -> 502.
"""

from __future__ import annotations


class LLMError(Exception):
    """Any failure talking to the speech-token LLM server."""

    def __init__(self, message: str, *, status_code: int | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        """The upstream HTTP status, when there was one."""
        self.body = body
        """The upstream response body (truncated), when there was one."""


class LLMUnavailable(LLMError):
    """The server cannot be reached, refused the connection, dropped it mid-stream, or answered 503."""


class LLMBadRequest(LLMError):
    """The server rejected the request with a 4xx (unknown field, wrong model name, prompt too long...)."""


class LLMServerError(LLMError):
    """The server failed with a 5xx, sent an error event mid-stream, or sent something unparseable."""


class LLMTimeout(LLMError):
    """Connecting, or waiting for the next token, took longer than the configured timeout."""
