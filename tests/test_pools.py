"""Endpoint pools: least-active routing, health, and failover with real servers.

Unit part: ``EndpointPool`` with fake clients (no servers). Integration part: the real pipeline
(``SpeechPipeline.from_settings``) over the session's shared vLLM and two real tritonservers with the
tiny token2wav; one Triton is SIGKILLed and requests keep succeeding, and an LLM list whose first
endpoint is dead still serves.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from backends.llm.vllm_launcher import free_port
from backends.serving.triton import TritonServer
from backends.voices.presets import write_builtin_voices
from gateway.pipeline import SpeechPipeline
from gateway.pools import EndpointPool
from gateway.settings import Settings
from gateway.synth import SpeechJob
from tests.support.triton_fixture import start_token2wav_server
from tests.support.vllm_fixture import shared_vllm


class FakeClient:
    def __init__(self, name: str, up: bool = True) -> None:
        self.name = name
        self.up = up
        self.closed = False

    async def probe(self) -> bool:
        return self.up

    async def close(self) -> None:
        self.closed = True


def make_pool(*names: str, **kwargs: object) -> EndpointPool[FakeClient]:
    clients = [FakeClient(n) for n in names]
    return EndpointPool("fake", [(c.name, c) for c in clients], FakeClient.probe, close=FakeClient.close, **kwargs)


async def test_least_active_wins_and_ties_rotate() -> None:
    pool = make_pool("a", "b", "c", health_interval_s=0)
    async with pool.acquire() as first, pool.acquire() as second, pool.acquire() as third:
        # Three concurrent utterances land on three different endpoints.
        assert {first.name, second.name, third.name} == {"a", "b", "c"}
        async with pool.acquire() as fourth:
            assert fourth.active == 2
    assert [e.active for e in pool.endpoints] == [0, 0, 0]
    # Sequential utterances (always a tie at 0) still visit every endpoint.
    seen = []
    for _ in range(6):
        async with pool.acquire() as endpoint:
            seen.append(endpoint.name)
    assert set(seen) == {"a", "b", "c"}


async def test_busy_endpoint_is_avoided() -> None:
    pool = make_pool("a", "b", health_interval_s=0)
    async with pool.acquire() as held:
        for _ in range(4):
            async with pool.acquire() as other:
                assert other is not held


async def test_down_endpoints_are_skipped_then_used_as_last_resort() -> None:
    pool = make_pool("a", "b", health_interval_s=0)
    a, b = pool.endpoints
    pool.mark_down(a, "connection refused")
    for _ in range(4):
        async with pool.acquire() as endpoint:
            assert endpoint is b
    pool.mark_down(b, "connection refused")
    async with pool.acquire() as endpoint:  # nothing is up: still try one (its error becomes a 503)
        assert endpoint in (a, b)
    assert pool.pick(exclude=[a, b]) is None
    with pytest.raises(LookupError):
        async with pool.acquire(exclude=[a, b]):
            pass


async def test_health_loop_marks_down_and_up_again() -> None:
    pool = make_pool("a", "b", health_interval_s=0.05)
    await pool.start()
    try:
        a, b = pool.endpoints
        assert a.healthy and b.healthy
        b.client.up = False
        for _ in range(1000):  # generous: a loaded machine may delay the loop
            if not b.healthy:
                break
            await asyncio.sleep(0.02)
        assert not b.healthy and b.failures >= 1
        assert await pool.check()  # a still serves
        b.client.up = True
        for _ in range(1000):  # generous: a loaded machine may delay the loop
            if b.healthy:
                break
            await asyncio.sleep(0.02)
        assert b.healthy and b.failures == 0
    finally:
        await pool.aclose()
    assert all(e.client.closed for e in pool.endpoints)


async def test_probe_exceptions_and_timeouts_count_as_down() -> None:
    async def hang(_: FakeClient) -> bool:
        await asyncio.sleep(3600)
        return True

    async def boom(_: FakeClient) -> bool:
        raise ConnectionError("refused")

    for probe in (hang, boom):
        pool = EndpointPool("fake", [("a", FakeClient("a"))], probe, health_interval_s=0, probe_timeout_s=0.05)
        assert not await pool.check()
        assert not pool.endpoints[0].healthy


def test_settings_single_url_is_a_pool_of_one_and_lists_parse_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    single = Settings(llm_url="http://x:1/v1", triton_url="t:1")
    assert single.llm_endpoints() == ["http://x:1/v1"]
    assert single.triton_endpoints() == ["t:1"]
    monkeypatch.setenv("TTS_LLM_URLS", '["http://a:1/v1", "http://b:2/v1"]')
    monkeypatch.setenv("TTS_TRITON_URLS", '["a:8001", "b:8001"]')
    listed = Settings()
    assert listed.llm_endpoints() == ["http://a:1/v1", "http://b:2/v1"]
    assert listed.triton_endpoints() == ["a:8001", "b:8001"]


# ----------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def two_tritons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TritonServer]]:
    llm = shared_vllm()  # start the shared vLLM first: the Tritons then pin clear of its cores
    assert llm.base_url
    root = tmp_path_factory.mktemp("pools")
    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda i: start_token2wav_server(root / f"t{i}"), range(2)))
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def pipeline_settings(tmp: Path, triton_urls: list[str], llm_urls: list[str] | None = None) -> Settings:
    llm = shared_vllm()
    voices = tmp / "voices"
    write_builtin_voices(voices)
    return Settings(
        llm_url=llm.base_url,
        llm_urls=llm_urls or [],
        llm_model=llm.model_name,
        llm_tokenizer_dir=str(llm.model_dir),
        triton_urls=triton_urls,
        voices_dir=str(voices),
        text_normalization=False,
        pool_health_interval_s=0,  # no probe loop: failover must come from the request path itself
        pool_probe_timeout_s=5,
    )


async def synthesize(pipeline: SpeechPipeline, index: int) -> np.ndarray:
    job = SpeechJob(request_id=f"pool-{index}", model="tts-1", input=f"hello pools number {index}", voice="alloy",
                    response_format="pcm")
    speech = await pipeline.prepare(job)
    chunks = [chunk async for chunk in speech.pcm()]
    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    assert audio.size > 0 and np.isfinite(audio).all()
    return audio


async def test_two_tritons_one_killed_requests_keep_succeeding(two_tritons: list[TritonServer], tmp_path: Path) -> None:
    alive, doomed = two_tritons
    settings = pipeline_settings(tmp_path, [alive.grpc_url, doomed.grpc_url])
    pipeline = SpeechPipeline.from_settings(settings)
    await pipeline.start()
    try:
        pool = pipeline.token2wav
        by_url = {e.name: e for e in pool.endpoints}
        assert all(e.healthy for e in pool.endpoints)
        for i in range(3):
            await synthesize(pipeline, i)
        assert by_url[alive.grpc_url].acquired >= 1 and by_url[doomed.grpc_url].acquired >= 1  # both served

        os.killpg(doomed._process.pid, signal.SIGKILL)  # the whole server, stubs included
        doomed._process.wait(timeout=30)
        before = by_url[alive.grpc_url].acquired
        for i in range(3, 7):
            await synthesize(pipeline, i)  # the dead one is found by the request path and skipped
        assert not by_url[doomed.grpc_url].healthy
        assert by_url[alive.grpc_url].acquired - before == 4
        assert all(e.active == 0 for e in pool.endpoints)
        assert await pipeline.ready() == {"llm": True, "token2wav": True}
    finally:
        await pipeline.aclose()


async def test_dead_llm_endpoint_is_routed_around(two_tritons: list[TritonServer], tmp_path: Path) -> None:
    alive = two_tritons[0]
    dead_llm = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    settings = pipeline_settings(tmp_path, [alive.grpc_url], llm_urls=[dead_llm, shared_vllm().base_url])
    pipeline = SpeechPipeline.from_settings(settings)
    await pipeline.start()
    try:
        dead, good = pipeline.llm.endpoints
        assert not dead.healthy and good.healthy  # the start-up probe already knows
        dead.healthy = True  # pretend the probe was stale: the request path must still route around it
        for i in range(3):
            await synthesize(pipeline, 100 + i)
        assert not dead.healthy
        assert good.acquired == 3
    finally:
        await pipeline.aclose()
