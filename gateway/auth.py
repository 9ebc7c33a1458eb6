"""API-key authentication for the ``/v1`` routes, answered the way OpenAI answers.

Keys come from ``TTS_API_KEYS`` (comma list) and/or ``TTS_API_KEYS_FILE`` (one per line); with none
configured auth is off (the local stack). Only ``/v1/...`` needs a key: probes (``/health``,
``/ready``), the OpenAPI document and, unless ``metrics_require_auth``, ``/metrics`` stay open, so
orchestrators and scrapers need no secret.

Keys are compared with ``hmac.compare_digest`` against every configured key (no early exit, so the
time taken says nothing about which key came close). A key is never logged; the rest of the gateway
sees only ``scope["state"]["api_key_id"]``, a short SHA-256 prefix used as the per-key admission
bucket.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.settings import Settings

log = logging.getLogger("gateway.auth")

MISSING_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


def load_api_keys(settings: Settings) -> list[str]:
    """The configured keys: ``api_keys`` (comma list) plus the lines of ``api_keys_file``."""
    keys = [k.strip() for k in settings.api_keys.get_secret_value().split(",")]
    if settings.api_keys_file:
        for line in Path(settings.api_keys_file).read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return list(dict.fromkeys(k for k in keys if k))


def key_id(key: str) -> str:
    """A non-secret name for a key (per-key admission bucket, safe to log)."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def mask_key(key: str) -> str:
    """How OpenAI echoes a wrong key: a few characters at each end, the rest starred."""
    if len(key) < 12:
        return "*" * len(key)
    return f"{key[:3]}{'*' * (len(key) - 7)}{key[-4:]}"


class InvalidAPIKeyError(APIError):
    """401 in OpenAI's shape (the SDK raises ``AuthenticationError`` and does not retry)."""

    def __init__(self, presented: str | None) -> None:
        if presented is None:
            super().__init__(401, MISSING_KEY_MESSAGE, type="invalid_request_error", code=None)
        else:
            super().__init__(
                401,
                f"Incorrect API key provided: {mask_key(presented)}. "
                "Ask the operator of this server for a valid API key.",
                type="invalid_request_error",
                code="invalid_api_key",
            )


def bearer_token(scope: Scope) -> str | None:
    """The token of ``Authorization: Bearer <token>``; None when absent or not Bearer."""
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer":
                return None
            return token.strip() or None
    return None


class APIKeyMiddleware:
    """Pure ASGI: checks the Bearer key of protected paths, 401 otherwise."""

    def __init__(
        self, app: ASGIApp, keys: list[str], *, protect_metrics: bool = False, metrics: GatewayMetrics | None = None
    ) -> None:
        self.app = app
        self.metrics = metrics
        self._keys = [k.encode() for k in keys]
        self._ids = [key_id(k) for k in keys]
        self.protect_metrics = protect_metrics

    def protects(self, path: str) -> bool:
        return path.startswith("/v1/") or path == "/v1" or (self.protect_metrics and path == "/metrics")

    def match(self, presented: str) -> str | None:
        """The id of the key equal to ``presented``; every key is compared (constant work)."""
        candidate = presented.encode()
        found: str | None = None
        for key, ident in zip(self._keys, self._ids):
            if hmac.compare_digest(candidate, key):
                found = ident
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._keys or not self.protects(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        presented = bearer_token(scope)
        ident = self.match(presented) if presented is not None else None
        if ident is None:
            log.info("request %s: rejected, %s API key", state.get("request_id"),
                     "missing" if presented is None else "invalid")
            if self.metrics is not None:
                self.metrics.error("invalid_api_key")
            response = InvalidAPIKeyError(presented).to_response(state.get("request_id"))
            await response(scope, receive, send)
            return
        state["api_key_id"] = ident
        await self.app(scope, receive, send)
