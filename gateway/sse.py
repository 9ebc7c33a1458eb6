"""Server-sent events of ``stream_format: "sse"``: one ``data: {json}`` line per event, no ``event:`` lines."""

from __future__ import annotations

import base64
import json
from typing import Any

CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def audio_delta(audio: bytes) -> bytes:
    """A slice of the one encoded file, standard base64."""
    return event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def audio_done(usage: dict[str, int]) -> bytes:
    return event({"type": "speech.audio.done", "usage": usage})


def error_event(envelope: dict[str, Any]) -> bytes:
    """A failure after the stream began: the error envelope, tagged like the other events."""
    return event({"type": "error", **envelope})
