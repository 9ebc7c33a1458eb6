"""Async streaming client for the speech-token LLM server (trtllm-serve, vLLM, or any OpenAI-style
completions server): one prompt in, speech token ids 0..6560 out, as they are generated.

Why it looks like this:
- One pooled ``aiohttp.ClientSession`` per server; every utterance is one streaming POST. aiohttp, not
  httpx: the LLM sends one SSE event per token per stream (64 streams at the replayer's 5 ms/token are
  12 800 events/s), and this client on httpx's pure-Python HTTP/1.1 path cost 85-115 us of event-loop
  time per event (64 streams: 0.7-0.9 of a core before any audio work), on aiohttp's C parser 40-50 us
  (docs/benchmarks.md, fourth GPU session).
- The stream is an async generator holding the HTTP response open. Leaving it early (``aclose()``,
  ``break`` inside ``async with contextlib.aclosing(...)``, or cancelling the task) releases the
  response half-read, and aiohttp closes a connection whose body was not read to its end rather than
  pool it; both trtllm-serve and vLLM abort a request whose client disconnected, so an abandoned
  utterance stops costing GPU time.
- Errors become the typed ``LLMError`` subclasses in ``gateway.llm.errors``.
- min_tokens: sent to the server (vLLM and trtllm-serve both implement it). A server that ignores it
  (older trtllm-serve 1.x) may end an utterance early; we accept that rather than fake it (a logit
  bias against eos would need the server to support ``logit_bias`` with token ids, which is exactly the
  kind of field those versions do not reliably have) and count it in ``early_eos_count`` and the log,
  so it shows up. ``send_min_tokens=False`` leaves the field out for a server that rejects it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.llm import vocab
from gateway.llm.dialects import DIALECTS, ChunkDecoder, SamplingParams, dialect_from_models, request_body
from gateway.llm.errors import LLMBadRequest, LLMError, LLMServerError, LLMTimeout, LLMUnavailable
from gateway.llm.prompt import CosyVoicePromptBuilder, LLMPrompt

__all__ = [
    "SpeechTokenLLM",
    "LLMError",
    "LLMUnavailable",
    "LLMBadRequest",
    "LLMServerError",
    "LLMTimeout",
]

log = logging.getLogger(__name__)

_BODY_SNIPPET = 500
_EOS_IDS = frozenset(vocab.EOS_IDS)


def _root_url(base_url: str) -> str:
    """Accept ``http://host:port`` and ``http://host:port/v1`` alike."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class SpeechTokenLLM:
    """Client of one speech-token LLM server.

    ``dialect``: "trtllm", "vllm", "openai" (text fallback) or "auto": detected from ``GET /v1/models``
    (its ``owned_by``: "vllm" / "tensorrt_llm"; anything else -> "openai"). Detection runs in
    ``start()``; if the server is not up yet, it runs again before the first stream.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt_builder: CosyVoicePromptBuilder,
        dialect: str = "auto",
        timeout_s: float = 60.0,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 50,
        repetition_penalty: float = 1.1,
        max_connections: int = 256,
        *,
        connect_timeout_s: float = 5.0,
        send_min_tokens: bool = True,
    ) -> None:
        if dialect != "auto" and dialect not in DIALECTS:
            raise ValueError(f"dialect must be 'auto' or one of {DIALECTS}, not {dialect!r}")
        self.root_url = _root_url(base_url)
        self.model = model
        self.prompt_builder = prompt_builder
        self.configured_dialect = dialect
        self.dialect: str | None = None if dialect == "auto" else dialect
        self.sampling = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty
        )
        self.send_min_tokens = send_min_tokens
        self.early_eos_count = 0
        """Utterances the server ended (eos) before their min_tokens: non-zero means it ignores min_tokens."""
        self.stray_token_count = 0
        """Generated ids that were neither speech tokens nor eos (dropped)."""
        # sock_read: the longest silence between two reads (a token, for a stream), as httpx's read timeout
        self._timeout = aiohttp.ClientTimeout(total=None, connect=min(connect_timeout_s, timeout_s),
                                              sock_read=timeout_s)
        self._max_connections = max_connections
        self._client: aiohttp.ClientSession | None = None

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Open the connection pool and, for ``dialect="auto"``, try to detect the dialect now."""
        if self._client is None:
            # Made here, not in __init__: a session belongs to the event loop that runs start().
            self._client = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_connections),
                auto_decompress=False, raise_for_status=False)
        if self.dialect is None:
            try:
                await self._detect_dialect()
            except LLMError as exc:
                log.warning("LLM dialect detection deferred (%s): will retry on first request", exc)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def __aenter__(self) -> SpeechTokenLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def ready(self) -> bool:
        """True when the server answers its health check (``/health``, else ``/v1/models``) with 200."""
        client = self._require_client()
        for path in ("/health", "/v1/models"):
            try:
                async with client.get(self.root_url + path) as response:
                    status = response.status
                    await response.read()  # leaves the connection reusable
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
            if status == 200:
                return True
            if status != 404:
                return False
        return False

    async def _detect_dialect(self) -> str:
        client = self._require_client()
        try:
            async with client.get(self.root_url + "/v1/models") as response:
                status, raw = response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from exc
        if status != 200:
            raise _status_error(status, raw.decode("utf-8", "replace"))
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            raise LLMServerError(f"unparseable /v1/models answer: {raw[:_BODY_SNIPPET]!r}") from exc
        self.dialect = dialect_from_models(payload)
        served = [card.get("id") for card in payload.get("data", [])]
        if self.model not in served:
            log.warning("LLM server serves %s, not %r: requests will likely be rejected", served, self.model)
        log.info("LLM server at %s speaks the %s dialect", self.root_url, self.dialect)
        return self.dialect

    def _require_client(self) -> aiohttp.ClientSession:
        if self._client is None:
            raise RuntimeError("SpeechTokenLLM.start() was not called")
        return self._client

    # ----------------------------------------------------------------- streaming

    def request_body(self, prompt: LLMPrompt) -> dict[str, Any]:
        """The JSON this client sends for ``prompt`` (dialect must be known)."""
        if self.dialect is None:
            raise RuntimeError("dialect not detected yet")
        return request_body(self.dialect, self.model, prompt, self.sampling, send_min_tokens=self.send_min_tokens)

    async def stream(self, prompt: LLMPrompt) -> AsyncIterator[int]:
        """Speech token ids (0..6560) as they arrive. Ends on an eos id, after ``prompt.max_tokens``
        tokens, or when the server ends the stream. Closing the generator closes the HTTP stream."""
        client = self._require_client()
        if self.dialect is None:
            await self._detect_dialect()
        body = self.request_body(prompt)
        decoder = ChunkDecoder()
        emitted = 0
        try:
            async with client.post(self.root_url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    raw = await response.read()
                    raise _status_error(response.status, raw.decode("utf-8", "replace"))
                finished = False  # [DONE] or a finish_reason seen: the server ended the stream on purpose
                async for line in _sse_lines(response.content):
                    if not line.startswith(b"data:"):
                        continue  # blank separators, SSE comments, keep-alives
                    data = line[len(b"data:"):].strip()
                    if data == b"[DONE]":
                        finished = True
                        break
                    vocab_ids, chunk_finished = _ids_of_event(decoder, data)
                    finished = finished or chunk_finished
                    for vocab_id in vocab_ids:
                        if vocab_id in _EOS_IDS:
                            if emitted < prompt.min_tokens:
                                self.early_eos_count += 1
                                log.warning("LLM ended after %d < min_tokens %d", emitted, prompt.min_tokens)
                            return
                        speech_token = vocab_id - vocab.SPEECH_TOKEN_BASE_ID
                        if not 0 <= speech_token < vocab.SPEECH_TOKEN_COUNT:
                            self.stray_token_count += 1
                            log.debug("dropping non-speech token id %d", vocab_id)
                            continue
                        yield speech_token
                        emitted += 1
                        if emitted >= prompt.max_tokens:
                            return
                if not finished:
                    raise LLMUnavailable(f"LLM stream ended without finishing after {emitted} tokens")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _transport_error(exc) from exc


async def _sse_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines (without the line break) as they arrive; no length limit per line (an event
    that echoes a long prompt's ids may be large)."""
    buffer = b""
    async for data in content.iter_any():
        buffer += data
        if b"\n" not in data:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer.rstrip(b"\r")


def _ids_of_event(decoder: ChunkDecoder, data: bytes) -> tuple[list[int], bool]:
    """Vocabulary ids carried by one SSE ``data:`` payload, and whether it carries a finish_reason;
    an error event raises."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError as exc:
        raise LLMServerError(f"unparseable SSE event from LLM server: {data[:_BODY_SNIPPET]!r}") from exc
    if not isinstance(event, dict):
        raise LLMServerError(f"unexpected SSE event from LLM server: {data[:_BODY_SNIPPET]!r}")
    if "error" in event:
        error = event["error"]
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        code = error.get("code") if isinstance(error, dict) else None
        status = code if isinstance(code, int) else None
        if status is not None and 400 <= status < 500:
            raise LLMBadRequest(f"LLM server rejected the request mid-stream: {message}", status_code=status)
        raise LLMServerError(f"LLM server failed mid-stream: {message}", status_code=status)
    ids: list[int] = []
    finished = False
    for choice in event.get("choices") or []:
        ids.extend(decoder.feed(choice))
        finished = finished or choice.get("finish_reason") is not None
    return ids, finished


def _status_error(status: int, body: str) -> LLMError:
    snippet = body[:_BODY_SNIPPET]
    if status == 503:
        return LLMUnavailable(f"LLM server unavailable (503): {snippet}", status_code=status, body=snippet)
    if 400 <= status < 500:
        return LLMBadRequest(f"LLM server rejected the request ({status}): {snippet}", status_code=status, body=snippet)
    return LLMServerError(f"LLM server error ({status}): {snippet}", status_code=status, body=snippet)


def _transport_error(exc: Exception) -> LLMError:
    """Map aiohttp's transport failures: no connection -> unavailable, silent -> timeout, dropped ->
    unavailable."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return LLMUnavailable(f"cannot connect to LLM server (timed out): {exc!r}")
    if isinstance(exc, asyncio.TimeoutError):  # includes aiohttp's SocketTimeoutError (sock_read)
        return LLMTimeout(f"LLM server timed out: {exc!r}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return LLMUnavailable(f"cannot connect to LLM server: {exc!r}")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return LLMUnavailable(f"LLM server dropped the connection: {exc!r}")
    return LLMServerError(f"LLM transport error: {exc!r}")
