"""The token2wav streaming service: what the Triton model does, testable without Triton.

Triton's sequence batcher routes every request of one correlation id to one model instance, but it
does not own the model's per-stream state: it never tells the model when it drops an idle sequence,
and a client that vanishes between chunks sends nothing at all. So this module keeps its own table
of live streams keyed by correlation id and frees an entry on END, on an explicit abort, on
cancellation, on any error inside the stream, and by a TTL reaper thread. Admission control (max
live streams, max state bytes) answers an "unavailable" error instead of letting the process run out
of memory. Prepared voices live in a bounded LRU keyed by the voice's content hash.

Errors carry a stable tag in their message (``[token2wav:unavailable]``, ``[token2wav:bad_request]``,
...) because Triton's gRPC stream delivers only an error string to the client, never a status code.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence

import numpy as np

from gateway.voices import LOOKAHEAD_PADS, conditioning_hash

log = logging.getLogger(__name__)

#: Speech token ids are FSQ codes 0..6560 (3^8 values).
MAX_SPEECH_TOKEN = 6560
SPEAKER_EMBEDDING_DIM = 192
MEL_BINS = 80


class Token2WavServiceError(Exception):
    """Base error; ``kind`` is the tag clients map to their own error types."""

    kind = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[token2wav:{self.kind}] {self.message}"


class BadRequest(Token2WavServiceError):
    kind = "bad_request"


class Unavailable(Token2WavServiceError):
    """Capacity exhausted: the client may retry later or elsewhere."""

    kind = "unavailable"


class Cancelled(Token2WavServiceError):
    kind = "cancelled"


class Engine(Protocol):
    """The part of ``backends.token2wav.engine.Token2WavEngine`` the service uses."""

    sample_rate: int

    def prepare_voice(self, prompt_tokens: np.ndarray, prompt_mel: np.ndarray, speaker_embedding: np.ndarray,
                      lookahead_pad: str = "silence") -> Any: ...

    def start_stream(self, voice: Any, seed: int = 0) -> Any: ...

    def feed(self, state: Any, tokens: np.ndarray, final: bool) -> np.ndarray: ...

    def state_nbytes(self, state: Any) -> int: ...


@dataclass(frozen=True)
class ServiceConfig:
    """Model parameters: from config.pbtxt ``parameters``, each overridable by ``TOKEN2WAV_<NAME>``."""

    model_dir: str = "/models/token2wav"
    device: str = "cpu"
    dtype: str = "float32"
    max_live_streams: int = 16
    """Streams one instance holds at once; a START beyond it is answered 'unavailable'."""
    max_state_mib: float = 0.0
    """Total per-stream state one instance may hold (0: no byte limit, only the stream count)."""
    stream_ttl_s: float = 60.0
    """A stream with no request for this long is freed (Triton drops idle sequences silently)."""
    voice_cache_size: int = 64
    """Prepared voices kept per instance (LRU)."""
    cuda_graphs: int = 1
    """1: on a CUDA device, replay the estimator solve and HiFT from CUDA graphs (0: eager)."""
    graph_mib: int = 16384
    """GPU memory the estimator's CUDA graphs may hold (beyond it, new shapes run eagerly)."""
    encoder_graph_mib: int = 8192
    """GPU memory the conformer encoder's CUDA graphs may hold (2.2-3.9 GiB per voice prompt length on an H100)."""
    compile_fused: int = 1
    """1: on a CUDA device, compile the DiT's elementwise groups into fused kernels (torch.compile, at
    the first solves: the warm-up); 0: run them as separate eager kernels."""
    calm_batch_rows: int = 4
    """Streams per engine call while every stream in it has ``calm_slack_ms`` of audio still to play
    (smaller calls finish sooner, so a new stream's first chunk waits less); otherwise up to the
    model's max_batch_size."""
    calm_slack_ms: int = 1000
    """Audio a listener must still have buffered for its stream's chunk to count as calm."""
    deadline_lookahead: int = 1
    """1: an engine call takes fewer streams when, by the call costs measured so far, a full one would
    make a listener waiting on another chunk size run dry (``backends.token2wav.scheduling``); 0: off."""
    trace_calls: int = 0
    """1: log one line per engine call (rows, chunk size, how long, how long its streams waited, the
    least audio their listeners had left) to the server's stderr: what a scheduling question needs."""
    warmup_prompt_tokens: int = 0
    """>0: at start, capture the CUDA graphs of every canonical chunk shape for voices with prompts of
    about this many tokens (the presets: 150), at batches up to the model's max_batch_size (0: off)."""

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], environ: Mapping[str, str] | None = None) -> "ServiceConfig":
        """Read string parameters (Triton's config), then let environment variables override them."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, default in cls().__dict__.items():
            raw = environ.get(env_name(name), parameters.get(name))
            if raw is None or str(raw) == "":
                continue
            values[name] = type(default)(raw)
        return cls(**values)


def env_name(parameter: str) -> str:
    """Environment variable that overrides one model parameter."""
    return "TOKEN2WAV_" + parameter.upper()


def parameter_env(**parameters: object) -> dict[str, str]:
    """Environment for a tritonserver process that overrides the given model parameters."""
    known = set(ServiceConfig().__dict__)
    unknown = set(parameters) - known
    if unknown:
        raise ValueError(f"unknown token2wav parameters {sorted(unknown)}; known: {sorted(known)}")
    return {env_name(name): str(value) for name, value in parameters.items()}


@dataclass
class VoiceTensors:
    """Conditioning tensors as they arrive with a START request (any leading singleton dims)."""

    prompt_tokens: np.ndarray
    prompt_mel: np.ndarray
    speaker_embedding: np.ndarray
    lookahead_pad: str = "silence"


@dataclass
class ChunkRequest:
    """One Triton request, decoded."""

    correlation_id: int
    start: bool
    end: bool
    tokens: np.ndarray
    abort: bool = False
    voice_id: str | None = None
    voice: VoiceTensors | None = None
    seed: int = 0


@dataclass
class ChunkResult:
    pcm: np.ndarray
    """float32 [S] produced by this request."""
    live_sequences: int
    """Streams this instance holds after the request."""


class VoiceCache:
    """Bounded LRU of prepared voice conditioning keyed by content hash (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("voice cache capacity must be at least 1")
        self.capacity = capacity
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries


@dataclass
class _Stream:
    state: Any
    voice_id: str
    last_used: float
    nbytes: int = 0
    busy: bool = False


@dataclass
class ServiceStats:
    started: int = 0
    ended: int = 0
    aborted: int = 0
    cancelled: int = 0
    reaped: int = 0
    failed: int = 0
    rejected: int = 0
    extra: dict = field(default_factory=dict)


class Token2WavService:
    """Sequence table + voice cache around one engine. One instance per Triton model instance.

    Under Triton, ``submit`` is called from the execute thread and the engine runs in the worker thread
    (``start_worker``); ``handle``/``handle_many`` run a batch in the caller's thread instead. The reaper
    runs in its own thread. A stream is marked busy while the engine works on it so the reaper never
    frees state under the engine's feet.
    """

    def __init__(self, engine: Engine, config: ServiceConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.config = config
        self.voices = VoiceCache(config.voice_cache_size)
        self.stats = ServiceStats()
        self._clock = clock
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._inbox: list[tuple[ChunkRequest, Reply]] = []
        self._inbox_ready = threading.Condition()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._answerer: threading.Thread | None = None

    # --- public API -------------------------------------------------------------------------

    def live_sequences(self) -> int:
        with self._lock:
            return len(self._streams)

    def live_state_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._streams.values())

    def handle(self, request: ChunkRequest) -> ChunkResult:
        """Run one request. Raises a ``Token2WavServiceError``; after any error the stream is gone."""
        result = self.handle_many([request])[0]
        if isinstance(result, Token2WavServiceError):
            raise result
        return result

    def handle_many(self, requests: Sequence[ChunkRequest],
                    on_result: Callable[[int, ChunkResult | Token2WavServiceError], None] | None = None,
                    ) -> list[ChunkResult | Token2WavServiceError]:
        """Run the requests of one batch (each of a different stream) to the end: a result or error each.

        The chunks that need the engine go to one engine batch (``feed_batch``), which synthesises
        chunks of several streams together; this is what keeps first audio flat as the number of
        concurrent streams grows. After any error the stream of that request is gone.
        ``on_result(index, result)`` is called for each request as soon as its result is known.
        """
        results: list[ChunkResult | Token2WavServiceError | None] = [None] * len(requests)

        def reply_to(index: int) -> Reply:
            def reply(result: ChunkResult | Token2WavServiceError) -> None:
                results[index] = result
                if on_result is not None:
                    on_result(index, result)
            return reply

        batch = _Batch(self)
        for index, request in enumerate(requests):
            batch.add(request, reply_to(index))
        while batch.step():
            pass
        return results  # type: ignore[return-value]

    def submit(self, requests: Sequence[ChunkRequest],
               on_result: Callable[[int, ChunkResult | Token2WavServiceError], None]) -> None:
        """Queue requests for the worker thread (``start_worker``); ``on_result(index, result)`` is
        called once per request, in the order results come, from the answer thread. Returns at once.

        Why a worker: Triton hands the model new requests only between two ``execute`` calls. If
        ``execute`` ran the engine itself, a stream's first chunk arriving meanwhile would wait for
        every chunk of that call; queued here, it joins the worker's very next engine call (first
        chunks go first). Requests of one stream run in the order submitted, one at a time.
        Why an answer thread: sending an answer is Triton's IPC round trip (~0.7 ms each, measured on
        an H100 host: ~11 ms per 16-stream call, 4 % of the engine's time), which the worker would
        otherwise spend with the GPU idle instead of starting the next call.
        """
        with self._inbox_ready:
            self._inbox.extend((request, functools.partial(self._answer_later, on_result, index))
                               for index, request in enumerate(requests))
            self._inbox_ready.notify()

    def start_worker(self) -> None:
        """Start the threads that serve ``submit``ted requests and send their answers (idempotent)."""
        if self._answerer is None:
            self._answerer = threading.Thread(target=self._answer, name="token2wav-answers", daemon=True)
            self._answerer.start()
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="token2wav-worker", daemon=True)
            self._worker.start()

    def _answer_later(self, on_result: Callable[[int, ChunkResult | Token2WavServiceError], None], index: int,
                      result: ChunkResult | Token2WavServiceError) -> None:
        self._answers.put((on_result, index, result))

    def _answer(self) -> None:
        while (item := self._answers.get()) is not None:
            on_result, index, result = item
            try:
                on_result(index, result)
            except Exception:  # the answer thread must never die: later answers are owed too
                log.exception("token2wav: answering a request failed")

    def _work(self) -> None:
        batch, waiting = _Batch(self), []
        while True:
            with self._inbox_ready:
                while not (self._stop.is_set() or self._inbox or waiting or batch.pending):
                    self._inbox_ready.wait(timeout=1.0)
                if self._stop.is_set():
                    return
                arrived, self._inbox = waiting + self._inbox, []
            waiting = []
            for request, reply in arrived:
                cid = request.correlation_id
                if batch.busy(cid) or any(r.correlation_id == cid for r, _ in waiting):
                    waiting.append((request, reply))  # after its stream's request in progress
                else:
                    batch.add(request, reply)
            try:
                batch.step()
            except Exception:  # the worker must never die: fail what was in progress, go on
                log.exception("token2wav worker: engine step failed")
                batch.fail_all(Token2WavServiceError("engine step failed (see the server log)"))
                batch = _Batch(self)

    def warm_up(self, max_rows: int) -> int:
        """Run ``engine.warm_up`` (if the engine has one) with a synthetic voice of
        ``config.warmup_prompt_tokens`` prompt tokens; returns its count of engine calls."""
        warm_up = getattr(self.engine, "warm_up", None)
        if warm_up is None or self.config.warmup_prompt_tokens <= 0:
            return 0
        from backends.token2wav.__main__ import random_voice  # the CLI's random conditioning (numpy only)

        arrays = random_voice(seed=0, n_tokens=self.config.warmup_prompt_tokens)
        voice = self.engine.prepare_voice(arrays["prompt_tokens"], arrays["prompt_mel"], arrays["speaker_embedding"])
        return int(warm_up(voice, max_rows=max_rows))

    def cancel(self, correlation_id: int) -> bool:
        """Free a stream whose client cancelled its request (gRPC cancellation)."""
        freed = self._free(correlation_id)
        if freed:
            self.stats.cancelled += 1
        return freed

    def reap_idle(self, now: float | None = None) -> int:
        """Free every stream idle for longer than the TTL; returns how many were freed."""
        now = self._clock() if now is None else now
        with self._lock:
            stale = [cid for cid, s in self._streams.items()
                     if not s.busy and now - s.last_used > self.config.stream_ttl_s]
            for cid in stale:
                del self._streams[cid]
        if stale:
            self.stats.reaped += len(stale)
            log.info("reaped %d idle sequences: %s", len(stale), stale)
        return len(stale)

    def start_reaper(self, interval_s: float | None = None) -> None:
        """Run ``reap_idle`` in a daemon thread every ``interval_s`` (default: a quarter of the TTL)."""
        if self._reaper is not None:
            return
        interval = interval_s if interval_s is not None else min(max(self.config.stream_ttl_s / 4, 0.05), 5.0)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.reap_idle()
                except Exception:  # the reaper must never die quietly
                    log.exception("reaper failed")

        self._reaper = threading.Thread(target=loop, name="token2wav-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        with self._inbox_ready:
            self._inbox_ready.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=30)
            self._worker = None
        if self._answerer is not None:  # after the worker: it sends what the worker answered last
            self._answers.put(None)
            self._answerer.join(timeout=30)
            self._answerer = None
        if self._reaper is not None:
            self._reaper.join(timeout=5)
            self._reaper = None
        with self._lock:
            self._streams.clear()

    # --- internals --------------------------------------------------------------------------

    def _begin(self, request: ChunkRequest) -> ChunkResult | tuple[_Stream, np.ndarray]:
        """Abort, probe, START or claim: an immediate result, or the stream and tokens to feed."""
        cid = request.correlation_id
        if request.abort:
            if self._free(cid):
                self.stats.aborted += 1
            return self._result(np.zeros(0, np.float32))
        tokens = _speech_tokens(request.tokens, "tokens")
        if request.start:
            if self._free(cid):
                log.warning("sequence %d restarted: previous state dropped", cid)
            if request.end and tokens.size == 0 and request.voice_id is None and request.voice is None:
                return self._result(np.zeros(0, np.float32))  # probe: reports the live count
            return self._open(request), tokens
        return self._claim(cid), tokens

    def _finish(self, request: ChunkRequest, stream: _Stream, output: Any) -> ChunkResult | Token2WavServiceError:
        """The answer to a request the engine worked on; frees or releases its stream."""
        cid = request.correlation_id
        if isinstance(output, Exception):  # the engine's state is unusable after a failed feed
            log.error("sequence %d: engine failed", cid, exc_info=output)
            error = Token2WavServiceError(f"engine failed on sequence {cid}: {output}")
            error.__cause__ = output
            return self._failed(cid, error)
        pcm = np.ascontiguousarray(output, dtype=np.float32).reshape(-1)
        if request.end:
            self._free(cid)
            self.stats.ended += 1
        else:
            self._release(cid, stream)
        return self._result(pcm)

    def _failed(self, cid: int, exc: Token2WavServiceError) -> Token2WavServiceError:
        if self._free(cid):
            self.stats.failed += 1
        if isinstance(exc, Unavailable):
            self.stats.rejected += 1
        return exc

    def _result(self, pcm: np.ndarray) -> ChunkResult:
        return ChunkResult(pcm=pcm, live_sequences=self.live_sequences())

    def _open(self, request: ChunkRequest) -> _Stream:
        voice_id, conditioning = self._resolve_voice(request)
        with self._lock:
            self._admit_locked()
            # Reserve the slot before the (slow) engine call so concurrent STARTs respect the limit.
            stream = _Stream(state=None, voice_id=voice_id, last_used=self._clock(), busy=True)
            self._streams[request.correlation_id] = stream
        try:
            stream.state = self.engine.start_stream(conditioning, seed=int(request.seed))
        except Exception as exc:
            self._free(request.correlation_id)
            raise Token2WavServiceError(f"could not start a stream: {exc}") from exc
        self.stats.started += 1
        return stream

    def _admit_locked(self) -> None:
        live = len(self._streams)
        if live >= self.config.max_live_streams:
            raise Unavailable(f"capacity: {live} live streams (max_live_streams={self.config.max_live_streams})")
        if self.config.max_state_mib > 0:
            used = sum(s.nbytes for s in self._streams.values())
            if used >= self.config.max_state_mib * 2**20:
                raise Unavailable(f"capacity: {used / 2**20:.1f} MiB of stream state "
                                  f"(max_state_mib={self.config.max_state_mib})")

    def _claim(self, cid: int) -> _Stream:
        with self._lock:
            stream = self._streams.get(cid)
            if stream is None:
                raise BadRequest(f"no live stream for correlation id {cid}: the first request needs START "
                                 "(or the stream already ended, was aborted, failed or idled out)")
            if stream.busy:
                raise BadRequest(f"stream {cid} already has a request in flight")
            stream.busy = True
            return stream

    def _release(self, cid: int, stream: _Stream) -> None:
        nbytes = int(self.engine.state_nbytes(stream.state))
        with self._lock:
            if self._streams.get(cid) is stream:
                stream.nbytes = nbytes
                stream.last_used = self._clock()
                stream.busy = False

    def _free(self, cid: int) -> bool:
        with self._lock:
            return self._streams.pop(cid, None) is not None

    def _resolve_voice(self, request: ChunkRequest) -> tuple[str, Any]:
        voice_id = request.voice_id
        if not voice_id:
            raise BadRequest("START needs voice_id (the voice's content hash)")
        cached = self.voices.get(voice_id)
        if cached is not None:
            return voice_id, cached
        if request.voice is None:
            raise BadRequest(f"unknown voice {voice_id}: not cached on this instance; send its conditioning "
                             "tensors (prompt_tokens, prompt_mel, speaker_embedding) with START")
        tokens, mel, embedding, pad = _voice_arrays(request.voice)
        actual = conditioning_hash(tokens, mel, embedding, pad)
        if actual != voice_id:
            raise BadRequest(f"voice_id {voice_id} does not match the conditioning tensors (their hash is {actual})")
        try:
            conditioning = self.engine.prepare_voice(tokens, mel, embedding, lookahead_pad=pad)
        except Exception as exc:
            raise BadRequest(f"could not prepare voice {voice_id}: {exc}") from exc
        self.voices.put(voice_id, conditioning)
        return voice_id, conditioning


Reply = Callable[[ChunkResult | Token2WavServiceError], None]


class _SerialFeed:
    """``feed_batch`` for engines that only have ``feed``: each feed runs when added."""

    pending = False

    def __init__(self, engine: Engine, on_result: Callable[[Hashable, Any], None]) -> None:
        self._engine = engine
        self._on_result = on_result

    def add(self, key: Hashable, state: Any, tokens: np.ndarray, final: bool) -> None:
        try:
            output: Any = self._engine.feed(state, tokens, final=final)
        except Exception as exc:  # noqa: BLE001 - reported per request
            output = exc
        self._on_result(key, output)

    def step(self) -> bool:
        return False


class _Batch:
    """Requests of one service in progress in one engine batch (``Token2WavEngine.feed_batch``)."""

    def __init__(self, service: Token2WavService) -> None:
        self._service = service
        self._active: dict[int, tuple[ChunkRequest, _Stream, Reply]] = {}
        self._keys = itertools.count()
        feed_batch = getattr(service.engine, "feed_batch", None)
        self._engine_batch = feed_batch(self._done) if feed_batch is not None else _SerialFeed(service.engine, self._done)

    @property
    def pending(self) -> bool:
        return bool(self._engine_batch.pending)

    def busy(self, correlation_id: int) -> bool:
        return any(request.correlation_id == correlation_id for request, _, _ in self._active.values())

    def add(self, request: ChunkRequest, reply: Reply) -> None:
        """Admit a request: answered at once (abort, probe, error) or handed to the engine."""
        service = self._service
        try:
            begun = service._begin(request)
        except Token2WavServiceError as exc:
            reply(service._failed(request.correlation_id, exc))
            return
        except Exception as exc:  # noqa: BLE001 - a bug here must not take the worker down
            log.exception("sequence %d: could not admit the request", request.correlation_id)
            reply(service._failed(request.correlation_id, Token2WavServiceError(f"could not admit the request: {exc}")))
            return
        if isinstance(begun, ChunkResult):
            reply(begun)
            return
        stream, tokens = begun
        key = next(self._keys)
        self._active[key] = (request, stream, reply)
        self._engine_batch.add(key, stream.state, tokens, request.end)

    def step(self) -> bool:
        return bool(self._engine_batch.step())

    def fail_all(self, error: Token2WavServiceError) -> None:
        for request, _, reply in self._active.values():
            reply(self._service._failed(request.correlation_id, error))
        self._active.clear()

    def _done(self, key: Hashable, output: Any) -> None:
        request, stream, reply = self._active.pop(key)  # type: ignore[arg-type]
        reply(self._service._finish(request, stream, output))


def _speech_tokens(array: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise BadRequest(f"{name} must be integer speech token ids, got dtype {array.dtype}")
    flat = array.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() > MAX_SPEECH_TOKEN):
        bad = flat[(flat < 0) | (flat > MAX_SPEECH_TOKEN)][:5].tolist()
        raise BadRequest(f"{name} must be speech token ids in 0..{MAX_SPEECH_TOKEN}, got {bad}")
    return flat


def _voice_arrays(voice: VoiceTensors) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Normalise wire shapes ([1,T], [1,2T,80], [1,192]) to the Voice shapes the hash is defined on."""
    tokens = _speech_tokens(voice.prompt_tokens, "prompt_tokens").astype(np.int32)
    mel = np.asarray(voice.prompt_mel)
    embedding = np.asarray(voice.speaker_embedding)
    if mel.dtype != np.float32 or embedding.dtype != np.float32:
        raise BadRequest("prompt_mel and speaker_embedding must be float32")
    if mel.size != 2 * tokens.size * MEL_BINS:
        raise BadRequest(f"prompt_mel must be [2T, {MEL_BINS}] for T={tokens.size}, got shape {mel.shape}")
    if embedding.size != SPEAKER_EMBEDDING_DIM:
        raise BadRequest(f"speaker_embedding must have {SPEAKER_EMBEDDING_DIM} values, got shape {embedding.shape}")
    if voice.lookahead_pad not in LOOKAHEAD_PADS:
        raise BadRequest(f"lookahead_pad must be one of {LOOKAHEAD_PADS}, got {voice.lookahead_pad!r}")
    if not (np.isfinite(mel).all() and np.isfinite(embedding).all()):
        raise BadRequest("prompt_mel and speaker_embedding must be finite")
    return tokens, mel.reshape(-1, MEL_BINS), embedding.reshape(-1), voice.lookahead_pad
