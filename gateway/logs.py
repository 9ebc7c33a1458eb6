"""Gateway logging: one handler on stderr for the gateway, its libraries and uvicorn.

``configure_logging`` runs when the production app is built (``gateway.app:app``), which uvicorn does
after it set up its own loggers: it takes uvicorn's handlers away and lets its records propagate to
the root handler installed here, so the whole process writes one format. ``TTS_LOG_FORMAT=json``
(the default) writes one JSON object per line (``gateway.middleware.JsonFormatter``), ``text`` one
readable line. Every record logged while a request is handled carries its ``x-request-id``
(``gateway.middleware.RequestIdFilter`` reads the context variable the request-context middleware
sets), whichever module or task logs it.

Nothing here logs request headers or settings, so API keys never reach a log line; the auth
middleware only ever handles a short hash of a key.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from gateway.middleware import JsonFormatter, RequestIdFilter

#: uvicorn's loggers that have handlers of their own (``uvicorn.error`` propagates to ``uvicorn``).
UVICORN_LOGGERS = ("uvicorn", "uvicorn.access")
#: Libraries that log every HTTP request at INFO (the pool's health probes would flood the log).
CHATTY_LOGGERS = ("httpx", "httpcore")


class TextFormatter(logging.Formatter):
    """``2025-01-01 12:00:00,123 INFO gateway.pipeline [req_…] message`` (the id only when known)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(request_tag)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.request_tag = f" [{request_id}]" if request_id else ""
        return super().format(record)


class GatewayLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``configure_logging`` owns (found again and replaced on a second call)."""


def configure_logging(log_format: str = "json", level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Route every record of the process through one handler writing ``log_format`` to ``stream``
    (stderr by default), at ``level`` and above. Idempotent: a second call replaces the handler.
    Handlers that others put on the root logger (e.g. pytest's) are left alone."""
    handler = GatewayLogHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, GatewayLogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    root.setLevel(numeric)
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for own in list(logger.handlers):
            logger.removeHandler(own)
        logger.propagate = True
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING) if numeric > logging.DEBUG else numeric)
    logging.captureWarnings(True)
    return handler
