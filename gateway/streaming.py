"""The ASGI response that streams one ``PreparedSpeech`` to the client, encoded, as audio or SSE.

Why a hand-written response rather than Starlette's ``StreamingResponse``:
- the client going away must close the PCM iterator at once (that cancels the LLM generation and the
  token2wav stream), even while we wait minutes for a slow backend; so ``http.disconnect`` is
  watched concurrently instead of being noticed only on the next write;
- headers are held back until the first PCM chunk exists: a synthesis that fails before producing
  any audio still gets a proper error status (a 503 the SDK retries) instead of a broken 200;
- after audio began, a failure must end the stream in a defined way: SSE sends an error event in the
  envelope shape and closes normally; raw audio closes the connection without the final chunk, so
  clients see a truncated transfer rather than a silently short file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import numpy as np
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway import sse
from gateway.audio import AudioEncoder
from gateway.errors import APIError
from gateway.synth import PreparedSpeech

log = logging.getLogger("gateway.streaming")

INTERNAL_ERROR = APIError(500, "The server had an error while synthesizing speech.", code="synthesis_failed")


class SpeechStreamResponse(Response):
    """Streams ``prepared.pcm()`` through ``encoder`` as chunked audio, or as SSE when ``sse``.

    A ``Response`` subclass only so FastAPI passes it through untouched; it does its own sending.
    """

    def __init__(self, prepared: PreparedSpeech, encoder: AudioEncoder, *, sse: bool, request_id: str) -> None:
        self.status_code = 200
        self.background = None
        self.prepared = prepared
        self.encoder = encoder
        self.sse = sse
        self.request_id = request_id
        self.content_type = sse_content_type() if sse else encoder.content_type
        self.media_type = self.content_type
        self.raw_headers = self._headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pcm = aiter(self.prepared.pcm())
        pump = asyncio.create_task(self._pump(pcm, scope, receive, send), name=f"speech-{self.request_id}")
        watcher = asyncio.create_task(_wait_for_disconnect(receive), name=f"disconnect-{self.request_id}")
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also reached when this coroutine is cancelled (server shutdown): stop both either way.
            if not pump.done():
                if watcher.done():
                    log.info("request %s: client disconnected, cancelling synthesis", self.request_id)
                pump.cancel()
            watcher.cancel()
            outcome, _ = await asyncio.gather(pump, watcher, return_exceptions=True)
            await _close(pcm)
        if isinstance(outcome, Exception):
            log.error("request %s: streaming the response failed: %r", self.request_id, outcome)

    async def _pump(self, pcm: AsyncIterator[np.ndarray], scope: Scope, receive: Receive, send: Send) -> None:
        try:
            first = await anext(pcm, None)
        except APIError as error:
            log.warning("request %s: synthesis failed before any audio: %r", self.request_id, error)
            await error.to_response(self.request_id)(scope, receive, send)
            return
        except Exception:
            log.exception("request %s: synthesis failed before any audio", self.request_id)
            await INTERNAL_ERROR.to_response(self.request_id)(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        await self._stream(first, pcm, send)

    async def _stream(self, first: np.ndarray | None, pcm: AsyncIterator[np.ndarray], send: Send) -> None:
        try:
            if first is not None:
                await self._send_audio(await self._encode(first), send)
                async for chunk in pcm:
                    await self._send_audio(await self._encode(chunk), send)
            tail = await self._flush()
        except Exception as exc:
            error = exc if isinstance(exc, APIError) else INTERNAL_ERROR
            log.error("request %s: synthesis failed after streaming began: %r", self.request_id, exc)
            if self.sse:
                await send(_body(sse.error_event(error.body()), more=False))
            # Raw audio: return without the final chunk; the server closes the connection.
            return
        await self._send_audio(tail, send)
        if self.sse:
            await send(_body(sse.audio_done(self.prepared.usage.as_dict()) + sse.DONE, more=True))
        await send(_body(b"", more=False))

    async def _send_audio(self, data: bytes, send: Send) -> None:
        if not data:
            return
        await send(_body(sse.audio_delta(data) if self.sse else data, more=True))

    async def _encode(self, chunk: np.ndarray) -> bytes:
        if self.encoder.uses_codec:
            # PyAV releases the GIL while encoding: a thread keeps the event loop free.
            return await asyncio.to_thread(self.encoder.encode, chunk)
        return self.encoder.encode(chunk)

    async def _flush(self) -> bytes:
        if self.encoder.uses_codec:
            return await asyncio.to_thread(self.encoder.flush)
        return self.encoder.flush()

    def _headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", self.content_type.encode())]
        if self.sse:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        return headers


def sse_content_type() -> str:
    return sse.CONTENT_TYPE


def _body(data: bytes, *, more: bool) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def _wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client is gone (the request body was fully read before streaming started)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _close(pcm: AsyncIterator[np.ndarray]) -> None:
    """Close the PCM iterator (idempotent), which cancels the backend work behind it."""
    aclose = getattr(pcm, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("closing the PCM iterator failed")
