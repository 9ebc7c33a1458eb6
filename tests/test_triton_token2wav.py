"""token2wav on a real tritonserver (nvidia-pytriton wheel), real engine, tiny random weights, gRPC aio.

One server for the module (started once; ~seconds). Tests run in order and each leaves zero live
streams, which the next one checks through the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from gateway.token2wav import (
    Token2WavBadRequest,
    Token2WavClient,
    Token2WavError,
    Token2WavUnavailable,
    map_error,
    new_correlation_id,
)
from gateway.voices import Voice
from tests.support.triton_fixture import random_tokens, random_voice, start_token2wav_server

MODEL = "token2wav_dit"
SAMPLES_PER_TOKEN = 960  # 2 mel frames per token x 480 samples per frame at 24 kHz
TTL_S = 3.0
MAX_LIVE_STREAMS = 4
CHUNKS = (18, 10, 7)  # first chunk: 15 tokens + 3 lookahead; the last one flushes


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    server = start_token2wav_server(
        tmp_path_factory.mktemp("t2w"),
        stream_ttl_s=TTL_S,
        max_live_streams=MAX_LIVE_STREAMS,
        voice_cache_size=2,
    )
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
async def client(triton_server):
    t2w = Token2WavClient(triton_server.grpc_url, MODEL, timeout_s=60)
    yield t2w
    await t2w.aclose()


@pytest.fixture(scope="session")
async def raw(triton_server):
    """Plain tritonclient, for requests our client would never send."""
    grpc = grpcclient.InferenceServerClient(triton_server.grpc_url)
    yield grpc
    await grpc.close()


@pytest.fixture
async def no_leaks(client):
    """Every test starts and ends with zero live streams on the server."""
    assert await client.live_sequences() == 0
    yield
    assert await client.live_sequences() == 0


async def run_stream(client: Token2WavClient, voice: Voice, tokens: list[int], seed: int = 0) -> list[np.ndarray]:
    chunks = []
    async with client.stream(voice, seed=seed) as stream:
        offset = 0
        for i, size in enumerate(CHUNKS):
            chunk = tokens[offset:offset + size]
            offset += size
            chunks.append(await stream.send(chunk, final=i == len(CHUNKS) - 1))
    return chunks


async def assert_healthy(client: Token2WavClient) -> None:
    """The server still serves a valid stream and holds nothing afterwards."""
    assert await client.ready()
    chunks = await run_stream(client, random_voice(7), random_tokens(7, sum(CHUNKS)))
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * sum(CHUNKS)
    assert await client.live_sequences() == 0


def raw_inputs(tokens: np.ndarray, datatype: str = "INT32", voice_id: str | None = None) -> list:
    inputs = [grpcclient.InferInput("tokens", list(tokens.shape), datatype)]
    inputs[0].set_data_from_numpy(tokens)
    if voice_id is not None:
        vid = grpcclient.InferInput("voice_id", [1, 1], "BYTES")
        vid.set_data_from_numpy(np.array([[voice_id.encode()]], dtype=np.object_))
        inputs.append(vid)
    return inputs


async def test_chunked_stream_gives_pcm_of_expected_length(client, no_leaks):
    voice = random_voice(1)
    tokens = random_tokens(1, sum(CHUNKS))
    chunks = await run_stream(client, voice, tokens)
    assert all(c.dtype == np.float32 for c in chunks)
    # The first chunk (15 + 3 lookahead tokens) gives 15 tokens of audio less HiFT's 8 cross-fade frames.
    assert chunks[0].size == 15 * SAMPLES_PER_TOKEN - 8 * 480
    assert sum(c.size for c in chunks) == SAMPLES_PER_TOKEN * len(tokens)
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0 and np.abs(audio).max() > 0


async def test_interleaved_streams_equal_their_solo_runs(client, no_leaks):
    voice_a, voice_b = random_voice(11), random_voice(12, prompt_tokens=9)
    tokens_a, tokens_b = random_tokens(21, sum(CHUNKS)), random_tokens(22, sum(CHUNKS))
    solo_a = np.concatenate(await run_stream(client, voice_a, tokens_a, seed=5))
    solo_b = np.concatenate(await run_stream(client, voice_b, tokens_b, seed=6))

    out_a, out_b = [], []
    async with client.stream(voice_a, seed=5) as stream_a, client.stream(voice_b, seed=6) as stream_b:
        offset = 0
        for i, size in enumerate(CHUNKS):
            final = i == len(CHUNKS) - 1
            out_a.append(await stream_a.send(tokens_a[offset:offset + size], final=final))
            out_b.append(await stream_b.send(tokens_b[offset:offset + size], final=final))
            if not final:
                assert await client.live_sequences() == 2
            offset += size
    np.testing.assert_allclose(np.concatenate(out_a), solo_a, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(out_b), solo_b, rtol=0, atol=1e-5)
    assert not np.allclose(solo_a[: solo_b.size], solo_b[: solo_a.size]), "different voices must sound different"


async def test_aborted_stream_is_freed_at_once(client, no_leaks):
    stream = client.stream(random_voice(2))
    await stream.send(random_tokens(2, 20))
    assert await client.live_sequences() == 1
    await stream.abort()
    assert await client.live_sequences() == 0
    with pytest.raises(Token2WavError):
        await stream.send([1, 2, 3])


async def test_leaving_the_context_without_final_aborts(client, no_leaks):
    with pytest.raises(RuntimeError):
        async with client.stream(random_voice(3)) as stream:
            await stream.send(random_tokens(3, 20))
            assert await client.live_sequences() == 1
            raise RuntimeError("the LLM failed mid-utterance")
    assert await client.live_sequences() == 0


async def test_cancelled_task_aborts_its_stream(client, no_leaks):
    sent = asyncio.Event()

    async def speak() -> None:
        async with client.stream(random_voice(4)) as stream:
            await stream.send(random_tokens(4, 20))
            sent.set()
            await asyncio.sleep(3600)  # waiting for more LLM tokens that never come

    task = asyncio.create_task(speak())
    await asyncio.wait_for(sent.wait(), 60)
    assert await client.live_sequences() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await client.live_sequences() == 0


async def test_task_cancelled_during_a_send_frees_its_stream(client, no_leaks):
    """Cancelled while a chunk is in flight: the gRPC call is cancelled and an abort follows."""
    for attempt in range(3):  # the cancel lands before, during or after the server's work: all must end clean
        stream = client.stream(random_voice(40 + attempt))

        async def speak() -> None:
            async with stream:
                await stream.send(random_tokens(40, 18 + 20 * attempt))

        task = asyncio.create_task(speak())
        await asyncio.sleep(0.05 * attempt)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert await client.live_sequences() == 0


async def test_abandoned_stream_is_reaped(client, no_leaks):
    stream = client.stream(random_voice(5))
    await stream.send(random_tokens(5, 20))  # then the client goes silent: no END, no abort
    assert await client.live_sequences() == 1
    deadline = time.monotonic() + 60  # hang guard only; the TTL is a few seconds
    while await client.live_sequences() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert await client.live_sequences() == 0
    with pytest.raises(Token2WavBadRequest, match="no live stream"):
        await stream.send(random_tokens(6, 5), final=True)  # Triton still routes it; the model says why
    await stream.abort()


async def test_two_hundred_streams_leave_no_state(client, no_leaks):
    voices = [random_voice(30 + i) for i in range(3)]  # more voices than the cache holds (2)

    async def one(i: int) -> None:
        voice, tokens = voices[i % 3], random_tokens(100 + i, 20)
        kind = i % 4
        if kind == 0:  # normal utterance
            async with client.stream(voice, seed=i) as stream:
                await stream.send(tokens[:18])
                await stream.send(tokens[18:], final=True)
        elif kind == 1:  # explicit abort (before the first audio: no engine work)
            async with client.stream(voice, seed=i) as stream:
                await stream.send(tokens[:5])
                await stream.abort()
        elif kind == 2:  # failure in the caller
            with pytest.raises(ValueError):
                async with client.stream(voice, seed=i) as stream:
                    await stream.send(tokens[:5])
                    raise ValueError("caller failed")
        else:  # a short utterance in one final request
            async with client.stream(voice, seed=i) as stream:
                pcm = await stream.send(tokens[:4], final=True)
                assert pcm.size == 4 * SAMPLES_PER_TOKEN

    for first in range(0, 200, MAX_LIVE_STREAMS):
        await asyncio.gather(*(one(i) for i in range(first, first + MAX_LIVE_STREAMS)))
    assert await client.live_sequences() == 0


async def test_wrong_dtype_is_rejected(client, raw, no_leaks):
    with pytest.raises(InferenceServerException) as info:
        await raw.infer(MODEL, raw_inputs(np.array([[1, 2, 3]], np.int64), "INT64"),
                        sequence_id=new_correlation_id(), sequence_start=True, sequence_end=True)
    assert "data-type" in info.value.message() and "INT32" in info.value.message()
    assert isinstance(map_error(info.value), Token2WavBadRequest)
    await assert_healthy(client)


@pytest.mark.parametrize("bad", [[6561], [-1], [5, 70000]])
async def test_token_ids_outside_range_are_rejected(client, bad, no_leaks):
    async with client.stream(random_voice(8)) as stream:
        await stream.send(random_tokens(8, 20))
        with pytest.raises(Token2WavBadRequest, match="0..6560"):
            await stream.send(bad)
    await assert_healthy(client)


async def test_chunk_without_start_is_rejected(client, raw, no_leaks):
    with pytest.raises(InferenceServerException) as info:  # Triton itself: unknown sequence, no START
        await raw.infer(MODEL, raw_inputs(np.array([[1, 2, 3]], np.int32)), sequence_id=new_correlation_id())
    assert "start" in info.value.message().lower()
    assert isinstance(map_error(info.value), Token2WavBadRequest)
    await assert_healthy(client)


async def test_unknown_voice_is_rejected_and_the_sequence_stays_dead(client, raw, no_leaks):
    cid = new_correlation_id()
    with pytest.raises(InferenceServerException) as info:
        await raw.infer(MODEL, raw_inputs(np.array([[1, 2, 3]], np.int32), voice_id="f" * 64),
                        sequence_id=cid, sequence_start=True)
    assert "unknown voice" in info.value.message()
    assert isinstance(map_error(info.value), Token2WavBadRequest)
    # Triton keeps the sequence open, the model does not: the next chunk gets a clear error.
    with pytest.raises(InferenceServerException) as info:
        await raw.infer(MODEL, raw_inputs(np.array([[4]], np.int32)), sequence_id=cid, sequence_end=True)
    assert "no live stream" in info.value.message()
    await assert_healthy(client)


async def test_voice_hash_mismatch_is_rejected(client, no_leaks):
    voice = random_voice(9)
    forged = dataclasses.replace(voice, speaker_embedding=voice.speaker_embedding + 1.0)
    forged.__dict__["content_hash"] = voice.content_hash  # claims another voice's hash (cached_property slot)
    async with client.stream(forged) as stream:
        with pytest.raises(Token2WavBadRequest, match="does not match"):
            await stream.send(random_tokens(9, 20))
    await assert_healthy(client)


async def test_capacity_limit_answers_unavailable(client, no_leaks):
    voice = random_voice(10)
    streams = [client.stream(voice, seed=i) for i in range(MAX_LIVE_STREAMS + 1)]
    for stream in streams[:-1]:
        await stream.send(random_tokens(10, 5))
    assert await client.live_sequences() == MAX_LIVE_STREAMS
    with pytest.raises(Token2WavUnavailable, match="capacity"):
        await streams[-1].send(random_tokens(10, 5))
    for stream in streams:
        await stream.__aexit__(None, None, None)
    assert await client.live_sequences() == 0
    await assert_healthy(client)


async def test_dead_server_is_unavailable():
    from backends.serving.triton import free_port

    dead = Token2WavClient(f"127.0.0.1:{free_port()}", MODEL, timeout_s=30)
    try:
        assert not await dead.ready()
        with pytest.raises(Token2WavUnavailable):
            await dead.live_sequences()
        with pytest.raises(Token2WavUnavailable):
            async with dead.stream(random_voice(1)) as stream:
                await stream.send(random_tokens(1, 5))
    finally:
        await dead.aclose()


def test_error_mapping_and_client_side_checks():
    assert isinstance(map_error(InferenceServerException("[token2wav:unavailable] capacity")), Token2WavUnavailable)
    assert isinstance(map_error(InferenceServerException("[token2wav:bad_request] unknown voice")), Token2WavBadRequest)
    assert isinstance(map_error(InferenceServerException("boom", status="StatusCode.UNAVAILABLE")), Token2WavUnavailable)
    assert type(map_error(InferenceServerException("[token2wav:internal] engine failed"))) is Token2WavError
    with pytest.raises(Token2WavBadRequest, match="int32"):
        from gateway.token2wav import _tokens_input

        _tokens_input([2**32 + 5])
