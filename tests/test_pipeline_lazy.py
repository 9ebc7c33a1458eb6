"""The pipeline prepares the head of the input first and the tail while the first segment generates.

Unit tests, no servers: the real ``SpeechPipeline``/``PreparedSpeech`` with an LLM double, a token2wav
double, the tiny tokenizer, and either a normalizer double whose tail normalization waits on an event
or the real normalizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from backends.llm.tiny import write_tiny_tokenizer
from gateway.errors import APIError
from gateway.llm.client import LLMUnavailable
from gateway.llm.prompt import CosyVoicePromptBuilder, LLMPrompt
from gateway.normalize import NormalizationStopped, default_normalizer
from gateway.pipeline import HEAD_CHARS, SpeechPipeline, get_schedule
from gateway.pools import EndpointPool
from gateway.segment import split_head
from gateway.synth import SpeechJob
from gateway.voices import Voice

WAIT_S = 10.0
EN = " ".join(f"On 2024-03-{d:02d} at 10:{d:02d} we paid ${d}.50 for {d * 1000} items." for d in range(1, 29))
ZH = "今天是2024年3月5日，价格是12.5元，共有1,000人参加。" * 10


class FakeLLM:
    """Yields ``prompt.min_tokens`` speech tokens per prompt; records the prompts and closed streams."""

    def __init__(self, normalizer: GatedNormalizer | None = None, delay_s: float = 0.0, down: bool = False) -> None:
        self.normalizer = normalizer
        self.delay_s = delay_s
        self.down = down
        self.prompts: list[LLMPrompt] = []
        self.tail_done_at_prompt: list[bool] = []  # was the tail normalized when this prompt arrived?
        self.emitted = 0
        self.closed_early = 0

    async def ready(self) -> bool:
        return not self.down

    async def stream(self, prompt: LLMPrompt) -> AsyncIterator[int]:
        if self.down:
            raise LLMUnavailable("cannot connect to LLM server (double)")
        self.prompts.append(prompt)
        if self.normalizer is not None:
            self.tail_done_at_prompt.append(self.normalizer.tail_done.is_set())
        finished = False
        try:
            for i in range(prompt.min_tokens):
                await asyncio.sleep(self.delay_s)
                self.emitted += 1
                yield i % 6561
            finished = True
        finally:
            if not finished:
                self.closed_early += 1


class FakeToken2WavStream:
    async def send(self, tokens: list[int], final: bool = False) -> np.ndarray:
        return np.full(len(tokens), 0.1, dtype=np.float32)  # one sample per token: easy to count


class FakeToken2Wav:
    async def ready(self) -> bool:
        return True

    @contextlib.asynccontextmanager
    async def stream(self, voice: Voice) -> AsyncIterator[FakeToken2WavStream]:
        yield FakeToken2WavStream()


_DIGITS = "zero one two three four five six seven eight nine".split()


def spoken(text: str) -> str:
    """The double's "normalization": each digit read as a word (character-wise, so sentence-wise)."""
    return re.sub(r"\d", lambda m: f" {_DIGITS[int(m.group())]} ", text)


class GatedNormalizer:
    """Head (``anormalize``): at once. Tail (``normalize``, in the worker thread): waits for
    ``release``, stopping when the request's ``stop`` event is set, like the real one between sentences."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.release = threading.Event()
        self.tail_started = threading.Event()
        self.tail_done = threading.Event()
        self.stopped = threading.Event()

    async def anormalize(self, text: str) -> str:
        return spoken(text)

    def normalize(self, text: str, stop: threading.Event | None = None) -> str:
        self.tail_started.set()
        while not self.release.wait(0.01):
            if stop is not None and stop.is_set():
                self.stopped.set()
                raise NormalizationStopped
        if self.fail:
            raise RuntimeError("tail normalization failed (double)")
        self.tail_done.set()
        return spoken(text)


class OneVoice:
    voice = Voice("alloy", "alloy", "", np.zeros(0, np.int32), np.zeros((0, 80), np.float32), np.zeros(192, np.float32))

    async def resolve(self, ref: object) -> Voice:
        return self.voice


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def make_pipeline(tokenizer_dir: Path, llm: FakeLLM, normalizer: object, *,
                  token2wav: FakeToken2Wav | None = None, schedule: str = "exponential") -> SpeechPipeline:
    pipeline = SpeechPipeline(
        EndpointPool("llm", [("llm", llm)], FakeLLM.ready),
        CosyVoicePromptBuilder(str(tokenizer_dir)),
        EndpointPool("token2wav", [("t2w", token2wav or FakeToken2Wav())], FakeToken2Wav.ready),
        OneVoice(),  # type: ignore[arg-type]
        context_tokens=2048,
        schedule=get_schedule(schedule),
    )
    if normalizer is not None:
        pipeline.normalizer = normalizer  # type: ignore[assignment]
    return pipeline


def job(text: str, request_id: str = "req") -> SpeechJob:
    return SpeechJob(request_id=request_id, model="tts-1", input=text, voice="alloy", response_format="pcm")


def texts(tokenizer_dir: Path, prompts: list[LLMPrompt]) -> Iterator[str]:
    """Each cross-lingual prompt's text: [sos, *text ids, task_id]."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for prompt in prompts:
        yield tokenizer.decode(prompt.token_ids[1 : 1 + prompt.text_token_count])


async def drain(pcm: AsyncIterator[np.ndarray]) -> int:
    return sum([chunk.size async for chunk in pcm])


async def test_the_llm_starts_before_the_tail_is_normalized(tokenizer_dir: Path) -> None:
    normalizer = GatedNormalizer()
    llm = FakeLLM(normalizer)
    pipeline = make_pipeline(tokenizer_dir, llm, normalizer)
    text = EN + " " + ZH
    speech = await asyncio.wait_for(pipeline.prepare(job(text)), WAIT_S)
    # prepare() returned with the first speech token while the tail's normalization cannot finish.
    assert llm.prompts and llm.tail_done_at_prompt[0] is False
    assert await asyncio.to_thread(normalizer.tail_started.wait, WAIT_S)  # started after the first token
    # The head's prompts come first; later ones of the head may still be sent while the tail normalizes.
    head, _ = split_head(text, HEAD_CHARS)
    head_prompts = len(pipeline.build_prompts(spoken(head), OneVoice.voice, None))
    normalizer.release.set()
    samples = await asyncio.wait_for(drain(speech.pcm()), WAIT_S)
    # every prompt of the tail waited for the tail's normalization
    assert len(llm.prompts) > head_prompts and all(llm.tail_done_at_prompt[head_prompts:])
    assert "".join(texts(tokenizer_dir, llm.prompts)) == spoken(text)
    assert samples == llm.emitted


async def test_segments_in_order_reassemble_into_the_normalized_input_and_usage_is_final(tokenizer_dir: Path) -> None:
    normalizer = default_normalizer()
    llm = FakeLLM()
    pipeline = make_pipeline(tokenizer_dir, llm, normalizer)
    text = EN + "\n\n" + ZH
    assert len(text) > 10 * HEAD_CHARS
    speech = await asyncio.wait_for(pipeline.prepare(job(text)), 60)
    head_tokens = speech.usage.input_tokens  # the head's only, so far
    samples = await asyncio.wait_for(drain(speech.pcm()), 60)
    segments = list(texts(tokenizer_dir, llm.prompts))
    assert len(segments) > 10
    assert "".join(segments) == normalizer.normalize(text)
    assert not any(ch.isdigit() for ch in "".join(segments))
    assert speech.usage.input_tokens == sum(p.text_token_count for p in llm.prompts) > head_tokens
    assert speech.usage.output_tokens == llm.emitted == samples


async def test_closing_the_stream_early_cancels_the_tail_and_the_llm(tokenizer_dir: Path) -> None:
    normalizer = GatedNormalizer()
    llm = FakeLLM(normalizer, delay_s=0.01)
    pipeline = make_pipeline(tokenizer_dir, llm, normalizer)
    speech = await asyncio.wait_for(pipeline.prepare(job(EN, request_id="early")), WAIT_S)
    pcm = speech.pcm()
    assert (await anext(pcm)).size
    assert await asyncio.to_thread(normalizer.tail_started.wait, WAIT_S)
    await pcm.aclose()  # the client left during the first segment
    assert await asyncio.to_thread(normalizer.stopped.wait, WAIT_S)  # the worker thread stopped early
    assert not normalizer.tail_done.is_set()
    await asyncio.sleep(0.05)
    assert llm.closed_early == 1 and len(llm.prompts) == 1
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name() in ("llm-early", "tail-early")]
    assert left == []


async def test_a_failing_tail_surfaces_after_the_heads_audio(tokenizer_dir: Path) -> None:
    normalizer = GatedNormalizer(fail=True)
    normalizer.release.set()
    llm = FakeLLM(normalizer)
    pipeline = make_pipeline(tokenizer_dir, llm, normalizer)
    speech = await asyncio.wait_for(pipeline.prepare(job(EN)), WAIT_S)
    received = 0
    with pytest.raises(RuntimeError, match="tail normalization failed"):
        async for chunk in speech.pcm():
            received += chunk.size
    assert received == llm.emitted > 0  # the head's audio first, all of it, then the failure


async def test_head_errors_are_raised_by_prepare_and_no_tail_work_starts(tokenizer_dir: Path) -> None:
    normalizer = GatedNormalizer()
    pipeline = make_pipeline(tokenizer_dir, FakeLLM(normalizer, down=True), normalizer)
    with pytest.raises(APIError) as info:
        await asyncio.wait_for(pipeline.prepare(job(EN)), WAIT_S)
    assert info.value.status == 503
    await asyncio.sleep(0.05)
    assert not normalizer.tail_started.is_set()


class RecordingToken2Wav(FakeToken2Wav):
    """Records each call's (token count, final flag); each call takes 50 ms, so a fast LLM gets ahead."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    @contextlib.asynccontextmanager
    async def stream(self, voice: Voice) -> AsyncIterator[FakeToken2WavStream]:
        calls = self.calls

        class Recording(FakeToken2WavStream):
            async def send(self, tokens: list[int], final: bool = False) -> np.ndarray:
                calls.append((len(tokens), final))
                await asyncio.sleep(0.05)
                return await super().send(tokens, final)

        yield Recording()


async def test_tokens_waiting_for_token2wav_go_in_calls_of_at_most_max_tokens(tokenizer_dir: Path) -> None:
    """The LLM double emits a long segment's tokens at once, as a fast LLM does while token2wav lags:
    they must not go in one huge call (GPU memory grows with the call), nor be lost or reordered."""
    class LongLLM(FakeLLM):
        async def stream(self, prompt: LLMPrompt) -> AsyncIterator[int]:
            for i in range(700):  # one segment of 28 s, generated faster than token2wav consumes it
                self.emitted += 1
                yield i % 6561
                await asyncio.sleep(0)

    llm = LongLLM()
    pipeline = make_pipeline(tokenizer_dir, llm, GatedNormalizer())
    recording = RecordingToken2Wav()
    pipeline.token2wav = EndpointPool("token2wav", [("t2w", recording)], FakeToken2Wav.ready)
    prepared = await pipeline.prepare(job("One sentence, one segment."))
    samples = await drain(prepared.pcm())
    schedule = pipeline.schedule
    sizes = [n for n, _ in recording.calls]
    assert samples == llm.emitted == sum(sizes) > 3 * schedule.max_tokens
    assert sizes[0] == schedule.first + schedule.lookahead
    assert max(sizes) <= schedule.max_tokens
    assert sum(1 for n in sizes if n == schedule.max_tokens) >= 2  # the backlog went in capped calls
    assert [final for _, final in recording.calls] == [False] * (len(sizes) - 1) + [True]


async def test_the_default_schedule_sends_token2wav_at_most_one_engine_chunk_per_call(tokenizer_dir: Path) -> None:
    """An LLM far ahead of token2wav (every token at once): the first call carries 15 + 3 tokens, and no
    call more than the engine's largest chunk (100), so each answer comes back after one chunk's work
    (a 200-token call was answered after two, while its listener needed only the first)."""
    from gateway.settings import Settings

    sizes: list[int] = []

    class RecordingStream(FakeToken2WavStream):
        async def send(self, tokens: list[int], final: bool = False) -> np.ndarray:
            sizes.append(len(tokens))
            await asyncio.sleep(0.01)  # the LLM's tokens pile up meanwhile
            return await super().send(tokens, final)

    class RecordingToken2Wav(FakeToken2Wav):
        @contextlib.asynccontextmanager
        async def stream(self, voice: Voice) -> AsyncIterator[FakeToken2WavStream]:
            yield RecordingStream()

    llm = FakeLLM()
    pipeline = make_pipeline(tokenizer_dir, llm, None, token2wav=RecordingToken2Wav(),
                             schedule=Settings.model_fields["chunk_schedule"].default)
    speech = await asyncio.wait_for(pipeline.prepare(job(spoken(EN[:600]))), WAIT_S)
    samples = await asyncio.wait_for(drain(speech.pcm()), WAIT_S)
    assert samples == llm.emitted > 300
    assert sizes[0] == 18 and max(sizes) == 100, sizes
