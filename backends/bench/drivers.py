"""The three ways to load the system, and the closed loop that runs them.

- ``HttpDriver``: the gateway over HTTP with the real async OpenAI SDK (what a customer sees).
- ``Token2WavDriver``: Triton directly with the gateway's own ``Token2WavClient`` and chunk schedule,
  speech tokens arriving on the replayer's timetable simulated in-process (no LLM, no gateway).
- ``PipelineDriver``: ``gateway.pipeline.SpeechPipeline`` in-process, built from ``Settings`` as the app
  builds it (LLM + Triton, no HTTP, no encoding). Compared with ``HttpDriver`` at the same settings it
  gives the gateway's HTTP + encoding overhead.

Closed loop (``run_level``): at concurrency c, c workers each run requests back to back until the
level's request count is used up; each request is timed from its own start.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import io
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from backends.bench.metrics import PCM16_BYTES_PER_SECOND, SAMPLE_RATE, RequestRecord
from backends.llm.replayer import Timetable

#: Sentences of different lengths (2-19 words) for the default text set; request i speaks text i mod 8.
DEFAULT_TEXTS = (
    "Hello there.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get this message.",
    "Streaming speech starts playing long before the whole sentence has been synthesized.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "Could you tell me the way to the train station, please?",
    "A benchmark is only as honest as the workload it replays, so we keep this one boring and repeatable.",
    "Thank you for waiting; your order has shipped and should arrive on Thursday afternoon.",
)

Clock = Callable[[], float]
"""Seconds since the current request started."""


def load_texts(spec: str) -> list[str]:
    """``default`` or a UTF-8 file with one input per line (blank lines skipped)."""
    if spec == "default":
        return list(DEFAULT_TEXTS)
    texts = [line.strip() for line in Path(spec).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"no texts in {spec}")
    return texts


def error_name(exc: BaseException) -> str:
    """A short error type for the tables: the class, plus the HTTP status where there is one."""
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    name = type(exc).__name__
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        name = "Timeout"
    return f"{name}({status})" if isinstance(status, int) else name


class Driver(Protocol):
    mode: str

    def params(self) -> dict: ...

    async def setup(self) -> None: ...

    async def request(self, record: RequestRecord, clock: Clock) -> None:
        """Run one request, appending (clock(), audio seconds) per audio chunk to ``record.arrivals``."""
        ...

    async def close(self) -> None: ...


async def run_level(
    driver: Driver, concurrency: int, requests: int, *, timeout_s: float, ramp_s: float = 0.0
) -> tuple[list[RequestRecord], float]:
    """``requests`` requests from ``concurrency`` closed-loop workers; returns the records (in start
    order) and the level's wall time. ``ramp_s`` spreads the workers' first requests evenly."""
    level_start = time.perf_counter()
    records: list[RequestRecord] = []
    next_index = 0

    async def one(record: RequestRecord) -> None:
        started = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - started

        try:
            await asyncio.wait_for(driver.request(record, clock), timeout_s)
        except Exception as exc:  # noqa: BLE001 - every failure is a data point
            record.error = error_name(exc)
            record.error_message = str(exc)[:300]
        record.finish(clock())

    async def worker(w: int) -> None:
        nonlocal next_index
        if ramp_s > 0 and concurrency > 1:
            await asyncio.sleep(ramp_s * w / concurrency)
        while next_index < requests:
            index, next_index = next_index, next_index + 1
            record = RequestRecord(concurrency=concurrency, index=index, worker=w, text_index=None,
                                   started_s=time.perf_counter() - level_start)
            await one(record)
            records.append(record)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return sorted(records, key=lambda r: r.index), time.perf_counter() - level_start


# --------------------------------------------------------------------------------------------- HTTP

def _decoded_seconds(body: bytes) -> float:
    """Duration of a compressed body, by decoding it (PyAV, a gateway dependency)."""
    import av

    samples, rate = 0, SAMPLE_RATE
    with av.open(io.BytesIO(body)) as container:
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate or rate
    return samples / rate


def byte_arrivals(response_format: str, chunks: Sequence[tuple[float, int]], body: bytes | None) -> list[tuple[float, float]]:
    """Audio seconds per received body chunk.

    pcm: bytes / 48 000 (s16le, 24 kHz mono); wav: the same after the 44-byte header; compressed
    formats: the decoded duration shared out in proportion to bytes (an approximation: exact for the
    totals, close for CBR mp3, rough for the underrun count of VBR formats).
    """
    if response_format in ("pcm", "wav"):
        header = 44 if response_format == "wav" else 0
        out = []
        for at, size in chunks:
            used = min(header, size)
            header -= used
            out.append((at, (size - used) / PCM16_BYTES_PER_SECOND))
        return out
    total_bytes = sum(size for _, size in chunks)
    seconds = _decoded_seconds(body) if body else 0.0
    return [(at, seconds * size / total_bytes if total_bytes else 0.0) for at, size in chunks]


class HttpDriver:
    """The gateway through ``AsyncOpenAI().audio.speech.with_streaming_response.create``.

    The SDK retries 429/5xx by default; here ``max_retries=0`` so every failure is counted.
    """

    mode = "http"

    def __init__(self, url: str, texts: Sequence[str], *, model: str = "tts-1", voice: str = "alloy",
                 response_format: str = "pcm", api_key: str = "bench", normalize: bool | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url, self.texts, self.model, self.voice = url, list(texts), model, voice
        self.response_format, self.api_key, self.normalize, self.timeout_s = response_format, api_key, normalize, timeout_s
        self.client = None

    def params(self) -> dict:
        return {"url": self.url, "model": self.model, "voice": self.voice, "response_format": self.response_format,
                "normalize": self.normalize, "texts": self.texts}

    async def setup(self) -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=self.url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def request(self, record: RequestRecord, clock: Clock) -> None:
        record.text_index = record.index % len(self.texts)
        extra = {"normalize": self.normalize} if self.normalize is not None else None
        chunks: list[tuple[float, int]] = []
        keep_body = self.response_format not in ("pcm", "wav")
        body = bytearray()
        try:
            async with self.client.audio.speech.with_streaming_response.create(  # type: ignore[union-attr]
                model=self.model, voice=self.voice, input=self.texts[record.text_index],
                response_format=self.response_format, extra_body=extra,
            ) as response:
                async for chunk in response.iter_bytes():
                    if chunk:
                        chunks.append((clock(), len(chunk)))
                        if keep_body:
                            body += chunk
        finally:
            if chunks:
                record.arrivals = byte_arrivals(self.response_format, chunks, bytes(body) if keep_body else None)


# ----------------------------------------------------------------------------------------- token2wav

def load_bench_voice(voice: str, voices_dir: str | None):
    """``voice``: an .npz path, a built-in name under ``voices_dir/builtin`` (else its default.npz), or
    ``random`` (a random conditioning entry with the local stack's shapes)."""
    from gateway.voices import load_voice

    if voice == "random":
        from backends.voices.presets import random_voice

        return random_voice("random", seed=0)
    path = Path(voice)
    if path.suffix == ".npz" and path.exists():
        return load_voice(path)
    if voices_dir:
        folder = Path(voices_dir) / "builtin"
        for candidate in (folder / f"{voice}.npz", folder / "default.npz"):
            if candidate.exists():
                return load_voice(candidate)
    raise FileNotFoundError(f"no voice {voice!r} (give an .npz path, a name with --voices-dir, or 'random')")


class Token2WavDriver:
    """Triton alone, fed like the gateway feeds it (``SpeechPipeline._segment_pcm``'s rules): wait for
    the schedule's next chunk size (or the end), then send every token that has arrived; the last call
    is ``final``. Token i of a request arrives at start + prefill + i x token_ms, its end (eos) one
    token later: the replayer's timetable (``backends.llm.replayer.Timetable``)."""

    mode = "token2wav"

    def __init__(self, triton: str, *, model: str = "token2wav_dit", voice: str = "alloy",
                 voices_dir: str | None = None, tokens: int = 250, prefill_ms: float = 20.0, token_ms: float = 5.0,
                 schedule: str = "exponential100", seed: int = 0, timeout_s: float = 600.0) -> None:
        self.triton, self.model, self.voice_spec, self.voices_dir = triton, model, voice, voices_dir
        self.tokens, self.seed, self.timeout_s, self.schedule_name = tokens, seed, timeout_s, schedule
        self.timetable = Timetable(prefill_ms / 1e3, token_ms / 1e3)
        self.client = None
        self.voice = None
        self.schedule = None

    def params(self) -> dict:
        return {"triton": self.triton, "model": self.model, "voice": self.voice_spec, "voices_dir": self.voices_dir,
                "tokens": self.tokens, "prefill_ms": self.timetable.prefill_s * 1e3,
                "token_ms": self.timetable.token_s * 1e3, "schedule": self.schedule_name, "seed": self.seed}

    async def setup(self) -> None:
        from gateway.pipeline import get_schedule
        from gateway.token2wav import Token2WavClient

        self.schedule = get_schedule(self.schedule_name)
        self.voice = load_bench_voice(self.voice_spec, self.voices_dir)
        self.client = Token2WavClient(self.triton, self.model, timeout_s=self.timeout_s)
        if not await self.client.ready():
            raise RuntimeError(f"Triton at {self.triton} does not report {self.model} ready")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def request(self, record: RequestRecord, clock: Clock) -> None:
        n, timetable, schedule = self.tokens, self.timetable, self.schedule
        rng = np.random.default_rng([self.seed, record.index])
        tokens = [int(t) for t in rng.integers(0, 6561, n)]
        record.tokens = n
        end_at = timetable.due(n)  # the eos
        taken, call = 0, 0
        async with self.client.stream(self.voice) as stream:  # type: ignore[union-attr]
            while True:
                needed = schedule.tokens_needed(call)  # type: ignore[union-attr]
                target = taken + needed - 1
                wake = timetable.due(target) if target < n else end_at
                while True:
                    delay = wake - clock()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    now = clock()
                    arrived = timetable.count_due(now, n)
                    finished = now >= end_at
                    if finished or arrived - taken >= needed:
                        break
                upto = min(arrived, taken + schedule.max_tokens)  # type: ignore[union-attr]
                chunk, taken = tokens[taken:upto], upto
                final = finished and taken >= n
                sent = clock()
                pcm = await stream.send(chunk, final=final)
                if call == 0:
                    record.first_chunk_s = clock() - sent
                if pcm.size:
                    record.arrivals.append((clock(), pcm.size / SAMPLE_RATE))
                call += 1
                if final:
                    return


# ------------------------------------------------------------------------------------------ pipeline

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("bench_record", default=None)


class _PerRequestMetrics:
    """The pipeline's ``BackendMetrics``: attributes each observation to the request whose task made
    it (``prepare`` and the PCM iteration run in the benchmark's own request task)."""

    def observe_llm_first_token(self, seconds: float) -> None:
        record = _current.get()
        if record is not None and record.llm_first_token_s is None:
            record.llm_first_token_s = seconds

    def observe_token2wav_chunk(self, seconds: float) -> None:
        record = _current.get()
        if record is not None and record.first_chunk_s is None:
            record.first_chunk_s = seconds


class PipelineDriver:
    """``SpeechPipeline.from_settings(Settings(...))``, ``prepare(SpeechJob)``, iterate ``pcm()``."""

    mode = "pipeline"

    def __init__(self, texts: Sequence[str], settings: dict, *, voice: str = "alloy", normalize: bool | None = None) -> None:
        self.texts, self.settings_kwargs, self.voice, self.normalize = list(texts), settings, voice, normalize
        self.pipeline = None
        self.settings = None

    def params(self) -> dict:
        settings = self.settings.model_dump(mode="json") if self.settings is not None else self.settings_kwargs
        settings = {k: v for k, v in settings.items() if "key" not in k and "redis" not in k}
        return {"settings": settings, "voice": self.voice, "normalize": self.normalize, "texts": self.texts}

    async def setup(self) -> None:
        from gateway.pipeline import SpeechPipeline
        from gateway.settings import Settings

        self.settings = Settings(**self.settings_kwargs)  # TTS_* environment variables fill the rest
        self.pipeline = SpeechPipeline.from_settings(self.settings)
        self.pipeline.attach_metrics(_PerRequestMetrics())
        await self.pipeline.start()
        ready = await self.pipeline.ready()
        if not all(ready.values()):
            await self.pipeline.aclose()
            raise RuntimeError(f"backends not ready: {ready}")

    async def close(self) -> None:
        if self.pipeline is not None:
            await self.pipeline.aclose()

    async def request(self, record: RequestRecord, clock: Clock) -> None:
        from gateway.synth import SpeechJob

        _current.set(record)  # this task's context only
        record.text_index = record.index % len(self.texts)
        job = SpeechJob(request_id=f"bench-{uuid.uuid4().hex[:12]}", model=self.settings.served_model,  # type: ignore[union-attr]
                        input=self.texts[record.text_index], voice=self.voice, response_format="pcm",
                        normalize=self.normalize)
        prepared = await self.pipeline.prepare(job)  # type: ignore[union-attr]
        try:
            async with contextlib.aclosing(prepared.pcm()) as pcm:
                async for chunk in pcm:
                    if chunk.size:
                        record.arrivals.append((clock(), chunk.size / SAMPLE_RATE))
            record.tokens = prepared.usage.output_tokens
        finally:
            aclose: Callable[[], Awaitable[None]] | None = getattr(prepared, "aclose", None)
            if aclose is not None:
                await aclose()
