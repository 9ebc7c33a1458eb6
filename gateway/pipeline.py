"""The speech pipeline: LLM speech tokens → chunk schedule → token2wav gRPC stream → PCM.

Per request:
- the input is normalized (``gateway.normalize``) and cut into segments that fit the LLM context
  (``gateway.segment``). Only its head (the first ``HEAD_CHARS`` characters, to a sentence end) is
  prepared before the LLM starts; the tail is normalized and segmented in a worker thread while the
  first segment generates, so time to first audio does not grow with the input's length;
- one producer task runs the LLM completions of all segments in order, putting speech tokens into one
  queue per segment and handing each queue to the consumer as the segment starts (a queue of queues:
  the number of segments is not known until the tail is ready); the consumer turns each segment into
  one token2wav stream. The producer runs ahead, so the next segment's LLM generation overlaps the
  current segment's token2wav;
- tokens reach token2wav in chunks given by a named ``ChunkSchedule``: the first chunk is small so the
  first audio comes fast, later chunks grow so the vocoder runs efficiently;
- closing the PCM iterator (client gone) cancels the producer, which closes the LLM HTTP stream (the
  server aborts the generation) and aborts the token2wav sequence, and stops the tail's preparation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.errors import APIError, RateLimitedError
from gateway.llm.client import LLMError, LLMUnavailable, SpeechTokenLLM
from gateway.llm.prompt import CosyVoicePromptBuilder, LLMPrompt
from gateway.pools import Endpoint, EndpointPool
from gateway.normalize import default_normalizer
from gateway.segment import split_head, split_into_segments
from gateway.settings import Settings
from gateway.synth import SpeechJob, Usage
from gateway.tempo import TempoStretcher
from gateway.token2wav import Token2WavClient, Token2WavError, Token2WavStream, Token2WavUnavailable
from gateway.voices import Voice, VoiceRegistry

log = logging.getLogger("gateway.pipeline")


@dataclass(frozen=True)
class ChunkSchedule:
    """How many speech tokens each token2wav call gets.

    The first call needs ``first`` tokens plus the ``lookahead`` the flow's pre-lookahead layer reads
    ahead; each later call fires once ``hops[i]`` new tokens arrived (the last hop repeats). When more
    tokens than that are waiting (token2wav is behind the LLM), they go together, at most
    ``max_tokens`` per call: a call's memory on the token2wav GPU grows with its size (the attention
    caches of a 300-token catch-up chunk took ~620 MB per stream and ran an H100 out of memory at 64
    streams), and bounded sizes repeat, so they replay from CUDA graphs.
    """

    name: str
    first: int
    lookahead: int
    hops: tuple[int, ...]
    max_tokens: int = 200

    def tokens_needed(self, call_index: int) -> int:
        if call_index == 0:
            return self.first + self.lookahead
        return self.hops[min(call_index - 1, len(self.hops) - 1)]


CHUNK_SCHEDULES: dict[str, ChunkSchedule] = {
    # Upstream Step-Audio2 / CosyVoice2 streaming: 15 + 3, then 25, 50, 100, 200 ... tokens.
    "exponential": ChunkSchedule("exponential", first=15, lookahead=3, hops=(25, 50, 100, 200)),
    # Steady 1 s chunks after the first: lower per-chunk latency, more calls.
    "fixed25": ChunkSchedule("fixed25", first=15, lookahead=3, hops=(25,), max_tokens=100),
    # Upstream's, with every call at most one token2wav chunk (100 tokens, the engine's largest): a
    # 200-token call is synthesised as two chunks but answered once, so its listener waits for both
    # while it needed only the first, and other streams about to stall wait behind them.
    "exponential100": ChunkSchedule("exponential100", first=15, lookahead=3, hops=(25, 50, 100), max_tokens=100),
}


def get_schedule(name: str) -> ChunkSchedule:
    try:
        return CHUNK_SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown chunk schedule {name!r}; known: {sorted(CHUNK_SCHEDULES)}") from None


def backend_unavailable(what: str, detail: str) -> APIError:
    return APIError(
        503,
        f"The {what} backend is unavailable, try again shortly ({detail}).",
        type="server_error",
        code="backend_unavailable",
        retry_after=1,
    )


_END = object()  # end of one segment's token stream, or of the stream of segments

#: Characters of input (whole sentences) normalized and segmented before the LLM starts: about one
#: segment's worth (~80 text tokens per segment with a 10 s voice prompt; numbers grow when spoken).
#: Normalizing costs up to ~1 ms per character of number-dense text, so this bounds that part of the
#: time to first audio; the rest is prepared while the first segment generates.
HEAD_CHARS = 150


class BackendMetrics(Protocol):
    """What the pipeline reports (``gateway.metrics.GatewayMetrics``, attached by the app)."""

    def observe_llm_first_token(self, seconds: float) -> None: ...

    def observe_token2wav_chunk(self, seconds: float) -> None: ...


class SpeechPipeline:
    """``Synthesizer`` implementation over the real LLM and token2wav clients.

    ``llm`` and ``token2wav`` are endpoint pools (``gateway.pools``): each segment takes the least-busy
    healthy LLM server and the least-busy healthy Triton; a single server is a pool of one.
    """

    def __init__(
        self,
        llm: EndpointPool[SpeechTokenLLM],
        prompts: CosyVoicePromptBuilder,
        token2wav: EndpointPool[Token2WavClient],
        voices: VoiceRegistry,
        *,
        context_tokens: int,
        schedule: ChunkSchedule,
        sample_rate: int = 24000,
        normalize_text: bool = True,
    ) -> None:
        self.llm = llm
        self.prompts = prompts
        self.token2wav = token2wav
        self.voices = voices
        self.context_tokens = context_tokens
        self.schedule = schedule
        self.sample_rate = sample_rate
        self.metrics: BackendMetrics | None = None
        self.normalize_text = normalize_text  # default when a request does not say (gateway/normalize.py)
        self.normalizer = default_normalizer()

    @classmethod
    def from_settings(cls, settings: Settings) -> SpeechPipeline:
        prompts = CosyVoicePromptBuilder(settings.llm_tokenizer_dir, context_tokens=settings.llm_context_tokens)
        llms = [
            SpeechTokenLLM(
                url,
                settings.llm_model,
                prompts,
                dialect=settings.llm_dialect,
                timeout_s=settings.llm_timeout_s,
                temperature=settings.llm_temperature,
                top_p=settings.llm_top_p,
                top_k=settings.llm_top_k,
                repetition_penalty=settings.llm_repetition_penalty,
                send_min_tokens=settings.llm_send_min_tokens,
            )
            for url in settings.llm_endpoints()
        ]
        tritons = [Token2WavClient(url, settings.triton_model, timeout_s=settings.triton_timeout_s)
                   for url in settings.triton_endpoints()]
        health = {"health_interval_s": settings.pool_health_interval_s, "probe_timeout_s": settings.pool_probe_timeout_s}
        llm = EndpointPool("llm", [(c.root_url, c) for c in llms], SpeechTokenLLM.ready,
                           close=SpeechTokenLLM.aclose, **health)
        token2wav = EndpointPool("token2wav", [(c.url, c) for c in tritons], Token2WavClient.ready,
                                 close=Token2WavClient.aclose, **health)
        return cls(
            llm,
            prompts,
            token2wav,
            VoiceRegistry(settings.voices_dir),
            context_tokens=settings.llm_context_tokens,
            schedule=get_schedule(settings.chunk_schedule),
            normalize_text=settings.text_normalization,
        )

    async def start(self) -> None:
        self.voices.load()
        if self.normalize_text:
            await asyncio.to_thread(self.normalizer.warm)
        for client in self.llm.clients:
            await client.start()
        await asyncio.gather(self.llm.start(), self.token2wav.start())

    async def aclose(self) -> None:
        await self.llm.aclose()
        await self.token2wav.aclose()

    def attach_metrics(self, metrics: BackendMetrics) -> None:
        self.metrics = metrics

    async def ready(self) -> dict[str, bool]:
        """Per-backend reachability (at least one endpoint of each), for /ready."""
        llm_ok, token2wav_ok = await asyncio.gather(self.llm.check(), self.token2wav.check())
        return {"llm": llm_ok, "token2wav": token2wav_ok}

    async def prepare(self, job: SpeechJob) -> PreparedSpeech:
        """Prepare the head of the input and wait for its first speech token; the tail follows lazily.

        Errors of the head (400 ``context_length_exceeded``, 503 for a dead LLM) are raised here, before
        the response starts. Cutting at a sentence end keeps the result exact: normalization is
        sentence-wise, so the head's and the tail's normalized texts concatenate to the whole input's.
        """
        voice = await self.voices.resolve(job.voice)
        normalize = self.normalize_text if job.normalize is None else job.normalize
        head, tail = split_head(job.input, HEAD_CHARS)
        if normalize:  # usage.input_tokens counts the text the LLM reads: the normalized text
            head = await self.normalizer.anormalize(head)
        prompts = self.build_prompts(head, voice, job.instructions)

        def tail_prompts(stop: threading.Event) -> list[LLMPrompt]:
            """Blocking, in a worker thread: normalize and segment the tail (stops early on ``stop``)."""
            text = self.normalizer.normalize(tail, stop) if normalize else tail
            return [] if stop.is_set() else self.build_prompts(text, voice, job.instructions)

        speech = PreparedSpeech(self, voice, prompts, job, tail=tail_prompts if tail.strip() else None)
        await speech.start()
        return speech

    def text_budget(self, voice: Voice, instructions: str | None) -> int:
        """Text tokens one segment may hold so prompt + 20x output fit the LLM context.

        Mirrors the prompt builder's choice of mode: instructions replace the voice's transcript and
        speech prefix; a voice without a transcript is used cross-lingually (no prefix).
        """
        if instructions and instructions.strip():
            prefix = self.prompts.count_tokens(instructions) + 1  # + <|endofprompt|>
        elif voice.prompt_text and len(voice.prompt_tokens):
            prefix = self.prompts.count_tokens(voice.prompt_text) + len(voice.prompt_tokens)
        else:
            prefix = 0
        return self.prompts.max_text_tokens(prefix + 2)  # + <|sos|>, <|task_id|>

    def build_prompts(self, text: str, voice: Voice, instructions: str | None) -> list[LLMPrompt]:
        budget = self.text_budget(voice, instructions)
        if budget < 1:
            param = "instructions" if instructions else "voice"
            raise APIError(
                400,
                f"The {param} leave no room for text in the model's {self.context_tokens}-token context; "
                "shorten them.",
                code="context_length_exceeded",
                param=param,
            )
        prompts = []
        for segment in split_into_segments(text, budget, self.prompts.count_tokens):
            if not segment.strip():
                continue
            prompts.append(
                self.prompts.build(
                    segment,
                    prompt_text=voice.prompt_text,
                    prompt_speech_tokens=voice.prompt_tokens.tolist(),
                    instructions=instructions or None,
                )
            )
        return prompts


class PreparedSpeech:
    """One request's synthesis: LLM producer task + token2wav consumer, exposed as a PCM iterator.

    ``prompts`` are the head's; ``tail`` (optional) is a blocking function that returns the rest of the
    prompts. It runs in a worker thread once the first speech token has arrived (until then the CPU
    belongs to the first segment: on small machines the LLM and the gateway share cores), and the
    producer generates its prompts after the head's. Segments reach the consumer through ``_segments``,
    a queue of per-segment token queues ended by ``_END`` (or by the exception that ended the producer
    outside a segment, e.g. a failure preparing the tail, which the consumer raises after the head's
    audio: in order, like any failure after the response began).
    """

    def __init__(
        self,
        pipeline: SpeechPipeline,
        voice: Voice,
        prompts: list[LLMPrompt],
        job: SpeechJob,
        *,
        tail: Callable[[threading.Event], list[LLMPrompt]] | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._voice = voice
        self._prompts = prompts
        self._job = job
        # The head's text tokens now; the tail's are added when its prompts are ready, so the count is
        # final by the time pcm() is exhausted.
        self.usage = Usage(input_tokens=sum(p.text_token_count for p in prompts), output_tokens=0)
        self._segments: asyncio.Queue[object] = asyncio.Queue()
        self._tail_work = tail
        self._tail: asyncio.Task[list[LLMPrompt] | Exception] | None = None
        self._tail_go = asyncio.Event()  # set once the first token arrived: the tail's thread may start
        self._tail_stop = threading.Event()  # set on cancel: the tail's thread stops between sentences
        self._producer: asyncio.Task[None] | None = None
        self._first_segment: asyncio.Queue[object] | None = None
        self._first: object | None = None

    async def start(self) -> None:
        """Start the LLM and wait for its first token, so a dead LLM is a 503 before the 200 is sent."""
        if self._tail_work is not None:
            self._tail = asyncio.create_task(self._prepare_tail(self._tail_work), name=f"tail-{self._job.request_id}")
        self._producer = asyncio.create_task(self._produce(), name=f"llm-{self._job.request_id}")
        if not self._prompts:  # nothing to say in the head (blank): the tail may start at once
            self._tail_go.set()
        asked = time.monotonic()
        try:
            segment = await self._next_segment()
            first = None if segment is None else await segment.get()
        except BaseException:  # cancelled (timeout, shutdown), or the tail failed: nothing may outlive us
            self._cancel()
            raise
        if segment is None:
            return
        self._first_segment, self._first = segment, first
        metrics = self._pipeline.metrics
        if metrics is not None and not isinstance(first, BaseException):
            metrics.observe_llm_first_token(time.monotonic() - asked)
        if isinstance(first, BaseException):
            self._cancel()
            raise self._as_api_error(first)
        self._tail_go.set()

    async def _prepare_tail(self, work: Callable[[threading.Event], list[LLMPrompt]]) -> list[LLMPrompt] | Exception:
        """The tail's prompts, or the exception preparing them raised: returned, not raised, so the
        producer hands it on in order, and a tail nobody awaits (the head failed) leaves no
        never-retrieved task exception behind."""
        await self._tail_go.wait()
        try:
            return await asyncio.to_thread(work, self._tail_stop)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            return exc

    async def _produce(self) -> None:
        """Generate the head's segments, then the tail's once they are ready; end ``_segments``."""
        if not await self._generate_each(self._prompts):
            return
        if self._tail is not None:
            tail = await self._tail
            if isinstance(tail, Exception):  # handed to the consumer, which raises it after the head
                log.error("preparing the rest of the input failed: %r", tail, extra={"request_id": self._job.request_id})
                self._segments.put_nowait(tail)
                return
            self.usage.input_tokens += sum(p.text_token_count for p in tail)
            if not await self._generate_each(tail):
                return
        self._segments.put_nowait(_END)

    async def _generate_each(self, prompts: list[LLMPrompt]) -> bool:
        """Each prompt's tokens into a new queue, handed to the consumer first; False after a failure
        (which went into that segment's queue: the consumer raises it there)."""
        for prompt in prompts:
            queue: asyncio.Queue[object] = asyncio.Queue()
            self._segments.put_nowait(queue)
            try:
                await self._generate(prompt, queue)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait(exc)
                return False
            queue.put_nowait(_END)
        return True

    async def _next_segment(self) -> asyncio.Queue[object] | None:
        """The next segment's token queue; None after the last; raises what ended the producer."""
        item = await self._segments.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]

    async def _generate(self, prompt: LLMPrompt, queue: asyncio.Queue[object]) -> None:
        """One segment on the least-busy LLM server; a server that is unreachable before its first
        token is marked down and the segment goes to the next one (nothing of it was used yet)."""
        pool = self._pipeline.llm
        tried: list[Endpoint[SpeechTokenLLM]] = []
        while True:
            async with pool.acquire(tried) as endpoint:
                emitted = 0
                try:
                    async with contextlib.aclosing(endpoint.client.stream(prompt)) as tokens:
                        async for token in tokens:
                            emitted += 1
                            self.usage.output_tokens += 1
                            queue.put_nowait(token)
                    return
                except LLMUnavailable as exc:
                    pool.mark_down(endpoint, exc)
                    tried.append(endpoint)
                    if emitted or len(tried) >= len(pool.endpoints):
                        raise

    async def aclose(self) -> None:
        """Stop the LLM work even if ``pcm()`` was never iterated (e.g. the client left first)."""
        self._cancel()

    def _cancel(self) -> None:
        self._tail_stop.set()
        for task in (self._tail, self._producer):
            if task is not None and not task.done():
                task.cancel()

    @staticmethod
    def _as_api_error(exc: BaseException) -> Exception:
        if isinstance(exc, LLMUnavailable):
            return backend_unavailable("speech-token LLM", type(exc).__name__)
        if isinstance(exc, Token2WavUnavailable) and "capacity" in str(exc):
            # token2wav's own admission control ("capacity: N live streams"): overload, like ours.
            return RateLimitedError("The speech backend is at capacity; retry shortly.", retry_after=1.0)
        if isinstance(exc, Token2WavUnavailable):
            return backend_unavailable("token2wav", str(exc) or type(exc).__name__)
        return exc

    async def pcm(self) -> AsyncIterator[np.ndarray]:
        stretcher = TempoStretcher(self._job.speed, self._pipeline.sample_rate) if self._job.speed != 1 else None
        try:
            segment, first = self._first_segment, self._first
            while segment is not None:
                async for chunk in self._segment_pcm(segment, first=first):
                    out = stretcher.process(chunk) if stretcher else chunk
                    if out.size:
                        yield out
                segment, first = await self._next_segment(), None
            if stretcher:
                tail = stretcher.flush()
                if tail.size:
                    yield tail
        except (LLMError, Token2WavError) as exc:
            log.error("synthesis failed after streaming began: %r", exc, extra={"request_id": self._job.request_id})
            raise self._as_api_error(exc) from exc
        finally:
            self._cancel()

    async def _segment_pcm(self, queue: asyncio.Queue[object], first: object | None) -> AsyncIterator[np.ndarray]:
        """Feed one segment's tokens to one token2wav stream following the chunk schedule."""
        schedule = self._pipeline.schedule
        pending: list[int] = []
        finished = False
        if first is not None:
            finished = self._take(first, pending)
        async with contextlib.AsyncExitStack() as held:
            stream: Token2WavStream | None = None
            call = 0
            while True:
                needed = schedule.tokens_needed(call)
                while not finished and len(pending) < needed:
                    finished = self._take(await queue.get(), pending)
                # token2wav fell behind: send what is waiting too, up to the schedule's cap per call
                while not finished and not queue.empty() and len(pending) < schedule.max_tokens:
                    finished = self._take(queue.get_nowait(), pending)
                chunk, pending = pending[:schedule.max_tokens], pending[schedule.max_tokens:]
                final = finished and not pending
                sent = time.monotonic()
                if stream is None:
                    stream, pcm = await self._open_stream(held, chunk, final)
                else:
                    pcm = await stream.send(chunk, final=final)
                if self._pipeline.metrics is not None:
                    self._pipeline.metrics.observe_token2wav_chunk(time.monotonic() - sent)
                call += 1
                if pcm.size:
                    yield pcm
                if final:
                    return

    async def _open_stream(
        self, held: contextlib.AsyncExitStack, tokens: list[int], final: bool
    ) -> tuple[Token2WavStream, np.ndarray]:
        """Start the segment's token2wav stream with its first chunk on the least-busy Triton.

        The whole segment then stays on that Triton (it holds the stream's state). A Triton that is
        unreachable or full for the first chunk is skipped (unreachable: also marked down) and the chunk
        goes to the next one: no audio of the segment exists yet, so nothing is lost.
        """
        pool = self._pipeline.token2wav
        tried: list[Endpoint[Token2WavClient]] = []
        while True:
            attempt = contextlib.AsyncExitStack()
            endpoint = await attempt.enter_async_context(pool.acquire(tried))
            try:
                stream = await attempt.enter_async_context(endpoint.client.stream(self._voice))
                pcm = await stream.send(tokens, final=final)
            except Token2WavUnavailable as exc:
                await attempt.aclose()
                if "capacity" not in str(exc):
                    pool.mark_down(endpoint, exc)
                tried.append(endpoint)
                if len(tried) >= len(pool.endpoints):
                    raise
                continue
            except BaseException:
                await attempt.aclose()
                raise
            held.push_async_exit(attempt)
            return stream, pcm

    @staticmethod
    def _take(item: object, pending: list[int]) -> bool:
        """Append a token; True at the end of the segment; raise what the producer raised."""
        if item is _END:
            return True
        if isinstance(item, BaseException):
            raise item
        pending.append(item)  # type: ignore[arg-type]
        return False

