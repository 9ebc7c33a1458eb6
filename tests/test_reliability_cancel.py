"""Cancellation on the real local stack: clients that leave at any point free every backend resource.

200 short requests are abandoned at random points (before the first byte, mid-way through raw audio,
during SSE), a few at a time; afterwards token2wav must report zero live sequences, vLLM zero running
requests (its Prometheus ``vllm:num_requests_running``) and the gateway zero active streams, each
polled with a generous deadline (a hang deadline, not a timing assertion). The stack is the
session's shared one (tests/support/stack_fixture.py).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import httpx
import pytest

from deploy.local.stack import GatewayProcess
from gateway.token2wav import Token2WavClient
from tests.support.stack_fixture import stack  # noqa: F401  (pytest fixture)

STREAMS = 200
CONCURRENCY = 8
# Generous for a loaded CPU box, yet shorter than token2wav's idle-stream reaper (stream_ttl_s 60 s in
# model_repo_dit): a sequence the gateway failed to abort would be freed only by the reaper, too late.
DRAIN_DEADLINE_S = 45
SHORT_INPUT = "Hi there."
MODES = ("before_first_byte", "mid_audio", "during_sse")


def prometheus_value(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in Prometheus text format."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[-1])
            found = True
    assert found, f"{name} not in the metrics"
    return total


async def abandon(client: httpx.AsyncClient, url: str, mode: str, rng: random.Random) -> str:
    """One request left at a random point; returns what happened (for the report)."""
    body = {"model": "tts-1", "voice": "alloy", "input": SHORT_INPUT, "response_format": "pcm"}
    if mode == "during_sse":
        body["stream_format"] = "sse"

    async def run() -> str:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"status_{response.status_code}"
            keep = rng.randint(0, 2)
            if mode == "during_sse":
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and (keep := keep - 1) < 0:
                        return "left_during_sse"
                return "completed"
            async for _ in response.aiter_raw():
                if (keep := keep - 1) < 0:
                    return "left_mid_audio"
            return "completed"

    if mode == "before_first_byte":
        task = asyncio.create_task(run())
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.5))
        if done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "left_before_first_byte"
        return task.result()
    return await run()


async def poll(what: str, probe, deadline_s: float = DRAIN_DEADLINE_S) -> float:
    """Poll ``probe()`` until it returns 0; fail with the last value after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    value: float = -1
    while time.monotonic() < deadline:
        value = await probe()
        if value == 0:
            return value
        await asyncio.sleep(0.5)
    pytest.fail(f"{what} still {value} after {deadline_s} s")


async def test_200_abandoned_streams_free_every_backend_resource(stack: GatewayProcess) -> None:  # noqa: F811
    rng = random.Random(7)
    url = stack.url
    llm_metrics_url = stack.env["TTS_LLM_URL"].removesuffix("/v1") + "/metrics"
    outcomes: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        queue = [MODES[i % len(MODES)] for i in range(STREAMS)]
        rng.shuffle(queue)

        async def worker(modes: list[str]) -> None:
            for mode in modes:
                outcomes[await abandon(client, url, mode, rng)] += 1

        await asyncio.gather(*(worker(queue[i::CONCURRENCY]) for i in range(CONCURRENCY)))
        assert sum(outcomes.values()) == STREAMS
        print(f"\n[cancel] outcomes of {STREAMS} abandoned requests: {dict(outcomes)}")
        assert not any(k.startswith("status_5") for k in outcomes), outcomes  # never a 5xx for load
        left = sum(v for k, v in outcomes.items() if k.startswith("left_"))
        assert left >= STREAMS // 2, outcomes  # most really were abandoned mid-way

        token2wav = Token2WavClient(stack.env["TTS_TRITON_URL"], timeout_s=60)
        try:
            await poll("token2wav live sequences", token2wav.live_sequences)
        finally:
            await token2wav.aclose()

        async def llm_running() -> float:
            return prometheus_value((await client.get(llm_metrics_url)).text, "vllm:num_requests_running")

        async def gateway_active() -> float:
            return prometheus_value((await client.get(f"{url}/metrics")).text, "tts_active_streams")

        await poll("vLLM running requests", llm_running)
        await poll("gateway active streams", gateway_active)

        # The stack still serves a whole request afterwards.
        response = await client.post(f"{url}/v1/audio/speech", json={
            "model": "tts-1", "voice": "alloy", "input": SHORT_INPUT, "response_format": "pcm"})
        assert response.status_code == 200 and len(response.content) > 0
