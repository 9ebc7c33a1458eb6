"""The client in the trtllm-serve dialect, against the protocol peer (tests/support/trtllm_peer.py, a
stand-in: trtllm-serve needs a GPU build). Also the error mapping and cancellation at protocol level."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.llm.tiny import write_tiny_tokenizer
from backends.llm.vllm_launcher import free_port
from gateway.llm.client import SpeechTokenLLM
from gateway.llm.errors import LLMBadRequest, LLMServerError, LLMTimeout, LLMUnavailable
from gateway.llm.prompt import CosyVoicePromptBuilder, LLMPrompt
from tests.support.trtllm_peer import TrtllmPeer

HANG_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> CosyVoicePromptBuilder:
    return CosyVoicePromptBuilder(str(write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture
def peer() -> Iterator[TrtllmPeer]:
    p = TrtllmPeer().start()
    yield p
    p.stop()


def prompt(builder: CosyVoicePromptBuilder, text: str = "Hello there", **bounds: int) -> LLMPrompt:
    p = builder.build(text, prompt_text="hi", prompt_speech_tokens=[1, 2, 3])
    for key, value in bounds.items():
        setattr(p, key, value)
    return p


async def collect(llm: SpeechTokenLLM, p: LLMPrompt) -> list[int]:
    return [t async for t in llm.stream(p)]


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_detects_trtllm_and_streams_token_ids(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    peer.state.eos_after = 30
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
        assert llm.dialect == "trtllm"
        assert await llm.ready()
        tokens = await collect(llm, prompt(builder, min_tokens=4, max_tokens=200))
    assert len(tokens) == 30  # stopped on the peer's eos1
    assert all(0 <= t <= 6560 for t in tokens)
    (sent,) = peer.state.requests
    assert sent["detokenize"] is False and "return_token_ids" not in sent
    assert peer.state.rejected == []


async def test_stops_at_max_tokens(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder, dialect="trtllm") as llm:
        tokens = await collect(llm, prompt(builder, min_tokens=0, max_tokens=7))
    assert len(tokens) == 7
    assert peer.state.requests[0]["max_tokens"] == 7


async def test_peer_rejects_unknown_fields_and_the_client_sends_none(
    peer: TrtllmPeer, builder: CosyVoicePromptBuilder
) -> None:
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder, dialect="trtllm") as llm:
        body = llm.request_body(prompt(builder))
        async with httpx.AsyncClient() as raw:
            bad = await raw.post(peer.base_url + "/completions", json={**body, "return_token_ids": True})
        assert bad.status_code == 400
        assert len(peer.state.rejected) == 1
        # the client's own requests pass the strict schema
        assert len(await collect(llm, prompt(builder, max_tokens=5))) == 5
        assert len(peer.state.rejected) == 1


async def test_text_fallback_dialect_yields_the_same_tokens(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    """The peer's tokens depend only on the prompt, so text parsing must reproduce the token-id path."""
    p = prompt(builder, min_tokens=0, max_tokens=25)
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder, dialect="trtllm") as llm:
        by_ids = await collect(llm, p)
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder, dialect="openai") as llm:
        by_text = await collect(llm, p)
    assert by_text == by_ids and len(by_ids) == 25
    assert "detokenize" not in peer.state.requests[1]


async def test_server_ignoring_min_tokens_is_accepted_and_counted(
    peer: TrtllmPeer, builder: CosyVoicePromptBuilder
) -> None:
    peer.state.honour_min_tokens = False
    peer.state.eos_after = 3
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
        tokens = await collect(llm, prompt(builder, min_tokens=16, max_tokens=100))
        assert len(tokens) == 3
        assert llm.early_eos_count == 1
        assert peer.state.requests[0]["min_tokens"] == 16


@pytest.mark.parametrize(
    ("status", "error"), [(400, LLMBadRequest), (404, LLMBadRequest), (500, LLMServerError), (503, LLMUnavailable)]
)
async def test_http_errors_are_typed(
    peer: TrtllmPeer, builder: CosyVoicePromptBuilder, status: int, error: type[Exception]
) -> None:
    peer.state.fail_status = status
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
        with pytest.raises(error) as caught:
            await collect(llm, prompt(builder))
    assert caught.value.status_code == status
    assert "injected failure" in (caught.value.body or "")


async def test_error_event_mid_stream(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    peer.state.error_after = 5
    got: list[int] = []
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
        with pytest.raises(LLMServerError, match="engine failure"):
            async for t in llm.stream(prompt(builder, max_tokens=50)):
                got.append(t)
    assert len(got) == 5


async def test_closing_the_stream_aborts_the_request(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    peer.state.token_delay_s = 0.05
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
        stream = llm.stream(prompt(builder, min_tokens=0, max_tokens=1000))
        async with contextlib.aclosing(stream):
            for _ in range(3):
                await anext(stream)
            assert peer.state.running == 1
        await wait_until(lambda: peer.state.aborted == 1 and peer.state.running == 0, "the peer to see the abort")
        assert peer.state.completed == 0
        # the pool is still usable
        assert len(await collect(llm, prompt(builder, min_tokens=0, max_tokens=4))) == 4


async def test_cancelling_the_consumer_task_aborts_the_request(
    peer: TrtllmPeer, builder: CosyVoicePromptBuilder
) -> None:
    peer.state.token_delay_s = 0.05
    got: list[int] = []
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:

        async def consume() -> None:
            async for t in llm.stream(prompt(builder, min_tokens=0, max_tokens=1000)):
                got.append(t)

        task = asyncio.create_task(consume())
        await wait_until(lambda: len(got) >= 2, "first tokens")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: peer.state.aborted == 1 and peer.state.running == 0, "the peer to see the abort")


async def test_slow_server_times_out(peer: TrtllmPeer, builder: CosyVoicePromptBuilder) -> None:
    peer.state.token_delay_s = 3.0
    async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder, timeout_s=0.3) as llm:
        with pytest.raises(LLMTimeout):
            await collect(llm, prompt(builder))


async def test_server_down_is_unavailable(builder: CosyVoicePromptBuilder) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    async with SpeechTokenLLM(url, "cosyvoice2", builder) as llm:  # auto: detection deferred, no raise
        assert llm.dialect is None
        assert not await llm.ready()
        with pytest.raises(LLMUnavailable):
            await collect(llm, prompt(builder))
    async with SpeechTokenLLM(url, "cosyvoice2", builder, dialect="vllm") as llm:
        with pytest.raises(LLMUnavailable):
            await collect(llm, prompt(builder))


async def test_server_dying_mid_stream_is_unavailable(builder: CosyVoicePromptBuilder) -> None:
    # killing the server mid-response makes uvicorn log the cancelled response: expected here
    peer = TrtllmPeer(token_delay_s=0.05, log_level="critical").start()
    try:
        async with SpeechTokenLLM(peer.base_url, "cosyvoice2", builder) as llm:
            got: list[int] = []
            with pytest.raises((LLMUnavailable, LLMServerError)):
                async for t in llm.stream(prompt(builder, min_tokens=0, max_tokens=1000)):
                    got.append(t)
                    if len(got) == 3:
                        peer._server.force_exit = True
                        peer._server.should_exit = True
            assert len(got) >= 3
    finally:
        peer.stop()


def test_min_tokens_can_be_switched_off_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TTS_LLM_SEND_MIN_TOKENS=false reaches every LLM client the gateway builds (older trtllm-serve
    rejects the field) and leaves it out of the request body."""
    from gateway.pipeline import SpeechPipeline
    from gateway.settings import Settings

    tokenizer_dir = write_tiny_tokenizer(tmp_path / "tok")
    monkeypatch.setenv("TTS_LLM_SEND_MIN_TOKENS", "false")
    monkeypatch.setenv("TTS_LLM_URLS", '["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"]')
    monkeypatch.setenv("TTS_LLM_DIALECT", "trtllm")
    pipeline = SpeechPipeline.from_settings(Settings(llm_tokenizer_dir=str(tokenizer_dir)))
    clients = [endpoint.client for endpoint in pipeline.llm.endpoints]
    assert len(clients) == 2 and all(not c.send_min_tokens for c in clients)
    body = clients[0].request_body(prompt(CosyVoicePromptBuilder(str(tokenizer_dir)), min_tokens=5, max_tokens=50))
    assert "min_tokens" not in body and body["max_tokens"] == 50


async def test_sse_lines_survive_any_split_and_long_events() -> None:
    """The stream's line splitter: events cut anywhere by the network, CRLF endings, and one event far
    above aiohttp's readline limit (128 KiB; an event that echoes a long prompt's ids can be large)."""
    from gateway.llm.client import _sse_lines

    big = b"data: " + b"1," * 100_000 + b"2"
    body = b"data: {\"a\":1}\r\n\r\n" + big + b"\n\ndata: [DONE]\n\n"

    class Pieces:  # the part of aiohttp.StreamReader the splitter uses
        def __init__(self, sizes: list[int]) -> None:
            self.sizes = sizes

        async def iter_any(self):
            at = 0
            for size in self.sizes:
                yield body[at:at + size]
                at += size
            if at < len(body):
                yield body[at:]

    expected = [b"data: {\"a\":1}", b"", big, b"", b"data: [DONE]", b""]
    for sizes in ([len(body)], [1] * 40 + [7, 3, 65_536], [15, 1, 1, 200_001]):
        assert [line async for line in _sse_lines(Pieces(sizes))] == expected
