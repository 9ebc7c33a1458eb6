"""Async gRPC client for the Triton ``token2wav_dit`` model (one bidirectional stream per utterance).

Protocol (see model_repo_dit/token2wav_dit/config.pbtxt): every request of an utterance carries one
random correlation id (uint64 on the server, < 2**63 because tritonclient sends int64); the first has START and the voice (its content hash plus, always, its
conditioning tensors, so any Triton instance can serve any voice without a shared store), the last
has END (it flushes the remaining audio). Each request answers with the PCM produced for its chunk.

A stream that ends any other way (exception, cancellation, ``abort()``) sends an abort so the server
frees the state at once rather than when its idle reaper fires.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any, AsyncIterator, Sequence

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.voices import Voice

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000


class Token2WavError(Exception):
    """token2wav failed for this utterance."""


class Token2WavUnavailable(Token2WavError):
    """Server down, timed out, or at capacity: retry later or elsewhere (maps to HTTP 503)."""


class Token2WavBadRequest(Token2WavError):
    """The server rejected what we sent (bad tokens, unknown voice, protocol misuse)."""


# Triton's stream responses carry only an error string; the model tags its own errors.
_UNAVAILABLE_MARKERS = ("[token2wav:unavailable]", "unavailable", "deadline_exceeded", "deadline exceeded",
                        "failed to connect", "connection refused", "socket closed", "not ready")
# Triton's own request validation (dtype/shape mismatch, missing START, bad correlation id).
_BAD_REQUEST_MARKERS = ("[token2wav:bad_request]", "unexpected", "expecting", "expects", "must specify", "invalid_argument",
                        "invalid argument")


def map_error(error: BaseException) -> Token2WavError:
    """Turn a tritonclient/grpc error into our error types."""
    if isinstance(error, Token2WavError):
        return error
    message = str(error)
    status = ""
    if isinstance(error, InferenceServerException):
        message = error.message() or message
        status = str(error.status() or "")
    elif isinstance(error, grpc.aio.AioRpcError):
        status = str(error.code())
        message = error.details() or message
    lowered = f"{status} {message}".lower()
    if "[token2wav:bad_request]" in lowered:
        return Token2WavBadRequest(message)
    if any(marker in lowered for marker in _UNAVAILABLE_MARKERS):
        return Token2WavUnavailable(message)
    if any(marker in lowered for marker in _BAD_REQUEST_MARKERS):
        return Token2WavBadRequest(message)
    return Token2WavError(message)


def _tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _tokens_input(tokens: Sequence[int] | np.ndarray) -> grpcclient.InferInput:
    array = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
    if array.size and (array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max):
        # int32 on the wire would wrap them into valid-looking ids; the server checks 0..6560 itself
        raise Token2WavBadRequest("speech token ids out of int32 range")
    return _tensor("tokens", array.astype(np.int32), "INT32")


def voice_inputs(voice: Voice, seed: int) -> list[grpcclient.InferInput]:
    """START's voice tensors: hash + conditioning (always sent; the model skips them on a cache hit)."""
    return [
        _tensor("voice_id", np.array([[voice.content_hash.encode()]], dtype=np.object_), "BYTES"),
        _tensor("prompt_tokens", np.asarray(voice.prompt_tokens, np.int32).reshape(1, -1), "INT32"),
        _tensor("prompt_mel", np.asarray(voice.prompt_mel, np.float32).reshape(1, -1, 80), "FP32"),
        _tensor("speaker_embedding", np.asarray(voice.speaker_embedding, np.float32).reshape(1, 192), "FP32"),
        _tensor("lookahead_pad", np.array([[voice.lookahead_pad.encode()]], dtype=np.object_), "BYTES"),
        _tensor("seed", np.array([[seed]], dtype=np.int64), "INT64"),
    ]


def new_correlation_id() -> int:
    """A random non-zero id below 2**63 (tritonclient sends it as int64; 0 means "no sequence")."""
    return secrets.randbits(63) or 1


#: gRPC reconnects a broken channel with exponential backoff that grows to 120 s by default, so after
#: a Triton restart requests could keep failing for minutes. A 1 s cap lets the gateway notice the
#: restarted server within about a second (without being restarted itself).
RECONNECT_BACKOFF_MS = {"initial": 100, "min": 100, "max": 1000}


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's default channel options plus the short reconnect backoff."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        *((f"grpc.{name}_reconnect_backoff_ms", ms) for name, ms in RECONNECT_BACKOFF_MS.items()),
    ]


class Token2WavClient:
    """One gRPC channel to one Triton; make many ``stream()``s over it concurrently."""

    def __init__(self, url: str, model: str = "token2wav_dit", timeout_s: float = 60.0) -> None:
        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._grpc_client: grpcclient.InferenceServerClient | None = None

    @property
    def _grpc(self) -> grpcclient.InferenceServerClient:
        """Made on first use: a grpc.aio channel belongs to the event loop it was created in, and the
        client object may be built before the server's loop runs (uvicorn imports the app first)."""
        if self._grpc_client is None:
            self._grpc_client = grpcclient.InferenceServerClient(url=self.url, channel_args=channel_args())
        return self._grpc_client

    async def ready(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._grpc.is_model_ready(self.model), self.timeout_s))
        except Exception:
            return False

    async def live_sequences(self) -> int:
        """Streams held by the instance the probe lands on (the whole server with one instance)."""
        result = await self._infer([_tokens_input([])], new_correlation_id(), start=True, end=True)
        return int(result.as_numpy("live_sequences").reshape(-1)[0])

    def stream(self, voice: Voice, seed: int = 0) -> "Token2WavStream":
        return Token2WavStream(self, voice, seed)

    async def aclose(self) -> None:
        if self._grpc_client is not None:
            await self._grpc_client.close()
            self._grpc_client = None

    async def __aenter__(self) -> "Token2WavClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _infer(self, inputs: list, sequence_id: int, *, start: bool = False, end: bool = False) -> Any:
        """A unary request (probe, abort fallback)."""
        try:
            return await asyncio.wait_for(
                self._grpc.infer(self.model, inputs, sequence_id=sequence_id, sequence_start=start,
                                 sequence_end=end, client_timeout=self.timeout_s),
                self.timeout_s,
            )
        except asyncio.TimeoutError:
            raise Token2WavUnavailable(f"token2wav did not answer within {self.timeout_s} s") from None
        except (InferenceServerException, grpc.aio.AioRpcError) as exc:
            raise map_error(exc) from exc


_CLOSE = object()
_CLOSE_WAIT_S = 5.0
"""How long leaving a stream waits for the server to end the gRPC call before cancelling it."""


class Token2WavStream:
    """One utterance: ``send`` token chunks in order, the last with ``final=True``.

    Use as an async context manager; leaving it without the final send aborts the server-side stream.
    One ``send`` at a time (each waits for its chunk's PCM).
    """

    def __init__(self, client: Token2WavClient, voice: Voice, seed: int = 0) -> None:
        self.client = client
        self.voice = voice
        self.seed = seed
        self.correlation_id = new_correlation_id()
        self._requests: asyncio.Queue = asyncio.Queue()
        self._responses: Any = None
        self._started = False
        self._finished = False
        self._failed = False
        self._dirty = False
        """A request went out whose response we did not read (cancelled or failed mid-way)."""

    async def __aenter__(self) -> "Token2WavStream":
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Shielded: a cancelled task still gets its server state freed (the inner task finishes it).
        await asyncio.shield(asyncio.ensure_future(self._leave()))

    async def _leave(self) -> None:
        if not self._finished:
            await self.abort()
        await self._end_call()

    async def send(self, tokens: Sequence[int] | np.ndarray, final: bool = False) -> np.ndarray:
        """Send one chunk; returns the float32 PCM (24 kHz) the server produced for it."""
        if self._finished:
            raise Token2WavError("stream already finished")
        if self._dirty or self._failed:
            raise Token2WavError("stream is broken by an earlier failed send; open a new one")
        inputs = [_tokens_input(tokens)]
        if not self._started:
            inputs += voice_inputs(self.voice, self.seed)
        request = {
            "model_name": self.client.model,
            "inputs": inputs,
            "sequence_id": self.correlation_id,
            "sequence_start": not self._started,
            "sequence_end": final,
        }
        if self._responses is None:
            self._responses = self.client._grpc.stream_infer(self._request_iterator())
        self._dirty = True
        self._requests.put_nowait(request)
        self._started = True
        try:
            result, error = await asyncio.wait_for(self._responses.__anext__(), self.client.timeout_s)
        except asyncio.TimeoutError:
            raise Token2WavUnavailable(f"token2wav did not answer within {self.client.timeout_s} s") from None
        except StopAsyncIteration:
            raise Token2WavUnavailable("token2wav closed the stream") from None
        except (InferenceServerException, grpc.aio.AioRpcError) as exc:
            raise map_error(exc) from exc
        self._dirty = False
        if error is not None:
            self._failed = True  # the model dropped the stream; __aexit__ still closes Triton's sequence
            raise map_error(error)
        if final:
            self._finished = True
        return np.asarray(result.as_numpy("pcm"), dtype=np.float32).reshape(-1)

    async def abort(self) -> None:
        """Free the stream on the server now (idempotent; never raises for a dead server)."""
        if self._finished:
            return
        self._finished = True
        if not self._started:
            return
        abort_inputs = [
            _tokens_input([]),
            _tensor("abort", np.array([[True]], dtype=np.bool_), "BOOL"),
        ]
        if not self._dirty and self._responses is not None:
            # The stream is in step: send the abort on it (ordered after our last chunk).
            self._requests.put_nowait({
                "model_name": self.client.model, "inputs": abort_inputs,
                "sequence_id": self.correlation_id, "sequence_start": False, "sequence_end": True,
            })
            self._dirty = True
            try:
                await asyncio.wait_for(self._responses.__anext__(), self.client.timeout_s)
                self._dirty = False
                return
            except Exception as exc:  # fall through to the unary path
                log.debug("abort on stream %d failed: %s", self.correlation_id, exc)
        # Out of step (a cancelled send): cancelling the call cancels any in-flight request, which
        # frees its stream; the unary abort covers a stream idle on the server.
        await self._end_call()
        try:
            await self.client._infer(abort_inputs, self.correlation_id, end=True)
        except Token2WavError as exc:
            log.debug("unary abort of %d: %s", self.correlation_id, exc)

    async def _request_iterator(self) -> AsyncIterator[dict]:
        while True:
            request = await self._requests.get()
            if request is _CLOSE:
                return
            yield request

    async def _end_call(self) -> None:
        """Half-close our side of the gRPC stream and let the server end the call.

        Cancelling instead would also work, but Triton 2.51 then holds the model for a while
        (with hundreds of cancelled streams its shutdown stalls until the exit timeout).
        """
        responses, self._responses = self._responses, None
        if responses is None:
            return
        self._requests.put_nowait(_CLOSE)
        if not self._dirty:
            try:
                await asyncio.wait_for(responses.__anext__(), min(self.client.timeout_s, _CLOSE_WAIT_S))
            except StopAsyncIteration:
                return
            except Exception as exc:
                log.debug("closing stream %d: %s", self.correlation_id, exc)
        responses.cancel()  # a request is still in flight (or the server did not close): cancel it
