"""The HTTP API against the OpenAI contract: the real app served by uvicorn, driven by the real
``openai`` SDK (sync, async, streaming), httpx, raw sockets and curl.

The synthesizer is a test double producing a deterministic sine sweep, so these tests pin the HTTP
surface and the encoders, not the models. Requests are counted server-side to prove the SDK never
retries a client error.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import av
import httpx
import numpy as np
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.errors import NotFoundError, ServiceUnavailableError
from gateway.settings import Settings
from gateway.synth import SpeechJob, Usage

SR = 24_000
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
#: What the double produces for a normal request: token2wav-like chunk sizes, 1.44 s in total.
CHUNK_SIZES = (10_560, 12_000, 12_000)
TOTAL_SAMPLES = sum(CHUNK_SIZES)
TOKENS_PER_SECOND = 25
HANG_S = 30  # generous deadline for things that must happen "promptly"; never a timing assertion


# --- test doubles ------------------------------------------------------------------------------------


def sine_sweep(n: int, start: int) -> np.ndarray:
    t = (np.arange(n) + start) / SR
    return (0.4 * np.sin(2 * np.pi * (150 * t + 300 * t * t))).astype(np.float32)


@dataclass
class SweepSpeech:
    """One prepared request of ``SineSweepSynthesizer``; records how its PCM iterator ended."""

    job: SpeechJob
    usage: Usage
    behaviour: str
    chunks_produced: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)

    async def pcm(self) -> AsyncIterator[np.ndarray]:
        self.started.set()
        position = 0
        try:
            if self.behaviour == "fail-before-audio":
                raise ServiceUnavailableError("token2wav is down (test double)", retry_after=2)
            if self.behaviour == "stall":
                await asyncio.sleep(3600)
            for index, size in enumerate(CHUNK_SIZES):
                if index > 0 and self.behaviour == "slow":
                    await asyncio.sleep(3600)
                if index > 0 and self.behaviour == "fail-after-first":
                    raise RuntimeError("token2wav stream broke (test double)")
                await asyncio.sleep(0)
                self.usage.output_tokens += round(size / SR * TOKENS_PER_SECOND)
                self.chunks_produced += 1
                yield sine_sweep(size, position)
                position += size
        finally:
            self.closed.set()


class SineSweepSynthesizer:
    """Synthesizer double: a deterministic sweep; behaviour picked by a marker in the input text."""

    MARKERS = ("fail-before-audio", "fail-after-first", "slow", "stall")

    def __init__(self) -> None:
        self.prepared: list[SweepSpeech] = []

    async def prepare(self, job: SpeechJob) -> SweepSpeech:
        if isinstance(job.voice, dict) and job.voice["id"] == "voice_missing":
            raise NotFoundError("Voice 'voice_missing' not found.", param="voice", code="voice_not_found")
        if isinstance(job.voice, dict) and job.voice["id"] == "voice_crash":
            raise RuntimeError("a bug in the synthesizer (test double)")
        behaviour = next((m for m in self.MARKERS if f"[{m}]" in job.input), "normal")
        speech = SweepSpeech(job, Usage(input_tokens=len(job.input.split())), behaviour)
        self.prepared.append(speech)
        return speech

    def last(self) -> SweepSpeech:
        return self.prepared[-1]

    def by_request_id(self, request_id: str) -> SweepSpeech:
        return next(p for p in self.prepared if p.job.request_id == request_id)


class RequestCounter:
    """ASGI wrapper counting the HTTP requests that reached the server, per (method, path)."""

    def __init__(self, app) -> None:
        self.app = app
        self.counts: Counter[tuple[str, str]] = Counter()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.counts[(scope["method"], scope["path"])] += 1
        await self.app(scope, receive, send)


@dataclass
class Server:
    url: str
    synth: SineSweepSynthesizer
    counter: RequestCounter

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def speech_requests(self) -> int:
        return self.counter.counts[("POST", "/v1/audio/speech")]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    synth = SineSweepSynthesizer()
    counter = RequestCounter(create_app(Settings(max_body_bytes=1_048_576), synth))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(counter, log_level="warning", timeout_graceful_shutdown=2)
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Server(f"http://127.0.0.1:{port}", synth, counter)
    uv.should_exit = True
    thread.join(HANG_S)
    sock.close()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    # Default max_retries (2): a retried client error would show up in the request counts.
    with openai.OpenAI(base_url=server.api, api_key="sk-test", timeout=HANG_S) as sdk:
        yield sdk


# --- helpers ---------------------------------------------------------------------------------------


def decode(data: bytes, fmt: str) -> tuple[int, int, float]:
    """(sample rate, channels, seconds) of a response body, as an ordinary decoder sees it."""
    if fmt == "pcm":
        assert len(data) % 2 == 0
        return SR, 1, len(data) / 2 / SR
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples, rate, channels = 0, 0, 0
        for frame in container.decode(stream):
            samples += frame.samples
            rate, channels = frame.sample_rate, frame.layout.nb_channels
    return rate, channels, samples / rate


def assert_audio(data: bytes, fmt: str, seconds: float = TOTAL_SAMPLES / SR) -> None:
    rate, channels, duration = decode(data, fmt)
    assert channels == 1
    assert rate == (48_000 if fmt == "opus" else SR)  # Opus decodes at 48 kHz by definition
    if fmt == "opus":
        assert struct.unpack_from("<I", data, data.index(b"OpusHead") + 12)[0] == SR
    assert abs(duration - seconds) <= (0.0 if fmt in ("wav", "pcm", "flac", "opus") else 0.12) + 1e-9
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[36:40] == b"data" and len(data) == 44 + 2 * TOTAL_SAMPLES
    if fmt == "pcm":
        assert len(data) == 2 * TOTAL_SAMPLES


def assert_envelope(response: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers.get("x-request-id", "").startswith("req_")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if 400 <= status < 500 and status != 429:
        assert response.headers["x-should-retry"] == "false"
    return error


def parse_sse(body: bytes) -> list[dict | str]:
    text = body.decode("utf-8")
    assert text.endswith("\n\n")
    events: list[dict | str] = []
    for block in text.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), block  # no event: lines
        payload = lines[0][len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def speech_body(**overrides) -> dict:
    return {"model": "tts-1", "input": "Hello there, world.", "voice": "alloy", **overrides}


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(HANG_S), f"{what} did not happen within {HANG_S} s"


# --- models, health, generic errors -------------------------------------------------------------------


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = [model.id for model in client.models.list()]
    for expected in ("cosyvoice2-dit", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-03-20"):
        assert expected in ids
    model = client.models.retrieve("gpt-4o-mini-tts")
    assert (model.id, model.object) == ("gpt-4o-mini-tts", "model")
    assert isinstance(model.created, int) and isinstance(model.owned_by, str)


def test_unknown_model_retrieve_is_404(server: Server, client: openai.OpenAI) -> None:
    before = server.counter.counts[("GET", "/v1/models/whisper-9")]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("whisper-9")
    assert_envelope(caught.value.response, 404, param="model", code="model_not_found")
    assert server.counter.counts[("GET", "/v1/models/whisper-9")] == before + 1


def test_health(server: Server) -> None:
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert response.headers["x-request-id"].startswith("req_")


def test_unknown_route_and_wrong_method_are_envelopes(server: Server) -> None:
    assert_envelope(httpx.get(server.api + "/nothing/here"), 404)
    assert_envelope(httpx.post(server.api + "/models"), 405)
    response = httpx.get(server.api + "/audio/speech")
    assert_envelope(response, 405)
    assert response.headers["allow"] == "POST"


def test_openapi_documents_the_speech_body(server: Server) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    body = spec["paths"]["/v1/audio/speech"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"} <= set(body["properties"])
    assert set(body["required"]) == {"model", "input", "voice"}


def test_request_ids_are_unique(server: Server) -> None:
    ids = {httpx.get(server.url + "/health").headers["x-request-id"] for _ in range(5)}
    assert len(ids) == 5


# --- successful speech ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_sdk_sync_every_format(server: Server, client: openai.OpenAI, fmt: str) -> None:
    response = client.audio.speech.create(model="tts-1", voice="coral", input="Hi there.", response_format=fmt)
    assert response.response.headers["content-type"] == CONTENT_TYPES[fmt]
    assert_audio(response.content, fmt)
    job = server.synth.last().job
    assert (job.model, job.voice, job.response_format, job.stream_format, job.speed) == ("tts-1", "coral", fmt, "audio", 1.0)
    assert job.request_id == response.response.headers["x-request-id"]


def test_sdk_streaming_response_is_chunked(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="nova", input="Streaming.", response_format="mp3"
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        assert "content-length" not in response.headers
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["x-request-id"].startswith("req_")
        data = b"".join(response.iter_bytes())
    assert_audio(data, "mp3")


@pytest.mark.parametrize("fmt", ["opus", "wav"])
async def test_sdk_async_streaming(server: Server, fmt: str) -> None:
    async with openai.AsyncOpenAI(base_url=server.api, api_key="sk-test", timeout=HANG_S) as sdk:
        async with sdk.audio.speech.with_streaming_response.create(
            model="tts-1-hd", voice="shimmer", input="Async.", response_format=fmt
        ) as response:
            assert response.headers["content-type"] == CONTENT_TYPES[fmt]
            data = b"".join([chunk async for chunk in response.iter_bytes()])
        assert_audio(data, fmt)
        plain = await sdk.audio.speech.create(model="tts-1", voice="echo", input="Async plain.", response_format="flac")
        assert_audio(plain.content, "flac")


@pytest.mark.parametrize("fmt", FORMATS)
def test_curl_every_format(server: Server, tmp_path, fmt: str) -> None:
    out, headers = tmp_path / "speech.bin", tmp_path / "headers.txt"
    result = subprocess.run(
        ["curl", "-sS", "-N", "-o", str(out), "-D", str(headers), "-w", "%{http_code}",
         "-H", "Content-Type: application/json", "--data-binary", "@-", server.api + "/audio/speech"],
        input=json.dumps(speech_body(voice="ash", response_format=fmt)).encode(),
        capture_output=True, timeout=HANG_S, check=True,
    )  # fmt: skip
    assert result.stdout == b"200"
    header_text = headers.read_bytes().decode().lower()
    assert f"content-type: {CONTENT_TYPES[fmt]}\r\n" in header_text
    assert "transfer-encoding: chunked" in header_text and "content-length" not in header_text
    assert "x-request-id: req_" in header_text
    assert_audio(out.read_bytes(), fmt)


@pytest.mark.parametrize("voice", ["alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage",
                                   "shimmer", "verse", "marin", "cedar"])  # fmt: skip
def test_every_builtin_voice_is_accepted(server: Server, voice: str) -> None:
    response = httpx.post(server.api + "/audio/speech", json=speech_body(voice=voice, response_format="pcm"))
    assert response.status_code == 200 and len(response.content) == 2 * TOTAL_SAMPLES
    assert server.synth.last().job.voice == voice


def test_fields_reach_the_job(server: Server, client: openai.OpenAI) -> None:
    client.audio.speech.create(
        model="cosyvoice2-dit",
        voice={"id": "voice_abc123"},  # type: ignore[arg-type]  # custom voice object
        input="Fields.",
        instructions="Speak slowly.",
        speed=2,
        response_format="pcm",
        extra_body={"some_future_field": {"x": 1}},  # unknown fields are ignored
    )
    job = server.synth.last().job
    assert job.voice == {"id": "voice_abc123"}
    assert job.instructions == "Speak slowly."
    assert job.speed == 2.0 and isinstance(job.speed, float)
    assert job.model == "cosyvoice2-dit"


def test_4096_e_acute_is_accepted(server: Server, client: openai.OpenAI) -> None:
    response = client.audio.speech.create(model="tts-1", voice="alloy", input="é" * 4096, response_format="wav")
    assert_audio(response.content, "wav")
    assert server.synth.last().job.input == "é" * 4096


# --- SSE ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mp3", "wav", "opus"])
def test_sse_events_decode_to_one_file_with_usage(server: Server, client: openai.OpenAI, fmt: str) -> None:
    response = client.audio.speech.create(
        model="tts-1", voice="sage", input="Server sent events here.", response_format=fmt, stream_format="sse"
    )
    assert response.response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = parse_sse(response.content)
    assert events[-1] == "[DONE]"
    done = events[-2]
    deltas = events[:-2]
    assert deltas and all(set(e) == {"type", "audio"} and e["type"] == "speech.audio.delta" for e in deltas)
    audio = b"".join(base64.b64decode(e["audio"], validate=True) for e in deltas)
    assert_audio(audio, fmt)
    assert done["type"] == "speech.audio.done" and set(done) == {"type", "usage"}
    usage = done["usage"]
    speech = server.synth.last()
    assert usage["input_tokens"] == speech.usage.input_tokens == 4
    assert usage["output_tokens"] == speech.usage.output_tokens > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_sse_failure_after_audio_began_ends_with_an_error_event(server: Server) -> None:
    response = httpx.post(
        server.api + "/audio/speech", json=speech_body(input="[fail-after-first] x", stream_format="sse"), timeout=HANG_S
    )
    assert response.status_code == 200
    events = parse_sse(response.content)
    assert events[0]["type"] == "speech.audio.delta"
    last = events[-1]
    assert last["type"] == "error" and set(last["error"]) == {"message", "type", "param", "code"}
    assert "[DONE]" not in events
    wait_for(server.synth.last().closed, "closing the PCM iterator")


# --- failures during synthesis -------------------------------------------------------------------


def test_audio_failure_after_streaming_began_truncates_the_transfer(server: Server, tmp_path) -> None:
    with httpx.stream("POST", server.api + "/audio/speech", json=speech_body(input="[fail-after-first] x"), timeout=HANG_S) as response:
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):
            b"".join(response.iter_raw())
    out = tmp_path / "partial.mp3"
    result = subprocess.run(
        ["curl", "-sS", "-o", str(out), "-H", "Content-Type: application/json",
         "--data-binary", json.dumps(speech_body(input="[fail-after-first] y")), server.api + "/audio/speech"],
        capture_output=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.returncode == 18  # CURLE_PARTIAL_FILE: the client can tell the audio is incomplete
    assert out.stat().st_size > 0
    # ... and the server keeps serving.
    assert httpx.post(server.api + "/audio/speech", json=speech_body(response_format="pcm")).status_code == 200


def test_failure_before_any_audio_is_a_retryable_503(server: Server) -> None:
    response = httpx.post(server.api + "/audio/speech", json=speech_body(input="[fail-before-audio] x"), timeout=HANG_S)
    assert_envelope(response, 503)
    assert response.headers["retry-after"] == "2"
    wait_for(server.synth.last().closed, "closing the PCM iterator")


def test_unknown_custom_voice_is_404_from_the_synthesizer(server: Server, client: openai.OpenAI) -> None:
    before = server.speech_requests()
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.speech.create(model="tts-1", voice={"id": "voice_missing"}, input="x")  # type: ignore[arg-type]
    assert_envelope(caught.value.response, 404, param="voice", code="voice_not_found")
    assert server.speech_requests() == before + 1


def test_unexpected_exception_is_a_500_envelope_with_request_id(server: Server) -> None:
    response = httpx.post(server.api + "/audio/speech", json=speech_body(voice={"id": "voice_crash"}))
    assert_envelope(response, 500)
    assert httpx.get(server.url + "/health").status_code == 200


# --- client disconnects ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_first_chunk_is_sent_before_the_next_exists_and_disconnect_closes(server: Server, fmt: str) -> None:
    """The first chunk's audio reaches the client while synthesis is still blocked on the second;
    dropping the connection then closes the PCM iterator (cancelling backend work)."""
    with httpx.Client(timeout=HANG_S) as http:
        with http.stream("POST", server.api + "/audio/speech", json=speech_body(input="[slow] x", response_format=fmt)) as response:
            assert response.status_code == 200
            chunks = response.iter_raw()  # keep a reference: a dropped httpx iterator closes the connection
            first = next(chunks)
            assert first
            speech = server.synth.by_request_id(response.headers["x-request-id"])
            assert speech.chunks_produced == 1 and not speech.closed.is_set()
    wait_for(speech.closed, "closing the PCM iterator after the client left")


def test_disconnect_before_first_chunk_closes(server: Server) -> None:
    body = json.dumps(speech_body(input="[stall] x")).encode()
    port = int(server.url.rsplit(":", 1)[1])
    before = len(server.synth.prepared)
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        sock.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # fmt: skip
        deadline = time.monotonic() + HANG_S
        while len(server.synth.prepared) == before:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        speech = server.synth.last()
        wait_for(speech.started, "synthesis start")
    wait_for(speech.closed, "closing the PCM iterator after the client left")
    assert speech.chunks_produced == 0


# --- bad input: 400/404 envelopes, exactly one request on the wire -------------------------------

BAD_REQUESTS = [
    ("missing input", {"model": "tts-1", "voice": "alloy"}, 400, "input", "missing_required_parameter"),
    ("missing voice", {"model": "tts-1", "input": "x"}, 400, "voice", "missing_required_parameter"),
    ("missing model", {"input": "x", "voice": "alloy"}, 400, "model", "missing_required_parameter"),
    ("empty input", speech_body(input=""), 400, "input", None),
    ("blank input", speech_body(input="   \n "), 400, "input", None),
    ("4097 chars", speech_body(input="a" * 4097), 400, "input", "string_above_max_length"),
    ("4097 é", speech_body(input="é" * 4097), 400, "input", "string_above_max_length"),
    ("bad voice", speech_body(voice="darth"), 400, "voice", "invalid_value"),
    ("voice object without id", speech_body(voice={"name": "x"}), 400, "voice", None),
    ("bad format", speech_body(response_format="ogg"), 400, "response_format", "invalid_value"),
    ("speed 0.2", speech_body(speed=0.2), 400, "speed", None),
    ("speed 4.1", speech_body(speed=4.1), 400, "speed", None),
    ("speed fast", speech_body(speed="fast"), 400, "speed", "invalid_type"),
    ("bad stream_format", speech_body(stream_format="websocket"), 400, "stream_format", "invalid_value"),
    ("instructions too long", speech_body(instructions="i" * 4097), 400, "instructions", "string_above_max_length"),
    ("input not a string", speech_body(input=42), 400, "input", "invalid_type"),
    ("unknown model", speech_body(model="tts-9000"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize(("name", "body", "status", "param", "code"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_via_sdk_is_one_request_and_an_envelope(
    server: Server, client: openai.OpenAI, name: str, body: dict, status: int, param: str, code: str | None
) -> None:
    before_requests, before_jobs = server.speech_requests(), len(server.synth.prepared)
    # The SDK validates nothing: send the raw body through its own transport and retry logic.
    with pytest.raises(openai.APIStatusError) as caught:
        client.post("/audio/speech", body=body, cast_to=bytes)
    assert caught.value.status_code == status
    assert_envelope(caught.value.response, status, param=param, code=code)
    assert server.speech_requests() == before_requests + 1  # no retry
    assert len(server.synth.prepared) == before_jobs  # rejected before synthesis


def test_sdk_speech_create_bad_speed_is_one_request(server: Server, client: openai.OpenAI) -> None:
    before = server.speech_requests()
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="tts-1", voice="alloy", input="x", speed=0.2)
    assert_envelope(caught.value.response, 400, param="speed")
    assert server.speech_requests() == before + 1


@pytest.mark.parametrize(
    ("name", "content", "content_type"),
    [
        ("malformed json", b'{"model": "tts-1", "input": ', "application/json"),
        ("array json", b'[{"model": "tts-1"}]', "application/json"),
        ("string json", b'"hello"', "application/json"),
        ("empty body", b"", "application/json"),
        ("not utf-8", b'{"input": "\xff\xfe"}', "application/json"),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "application/json"),
        ("wrong content type", json.dumps(speech_body()).encode(), "text/plain"),
        ("form content type", b"model=tts-1&input=x&voice=alloy", "application/x-www-form-urlencoded"),
        ("no content type", json.dumps(speech_body()).encode(), None),
    ],
)
def test_malformed_bodies_are_400_envelopes(server: Server, name: str, content: bytes, content_type: str | None) -> None:
    before = server.speech_requests()
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(server.api + "/audio/speech", content=content, headers=headers)
    assert_envelope(response, 400)
    assert server.speech_requests() == before + 1


def test_unpaired_surrogate_in_input_is_400(server: Server) -> None:
    content = b'{"model": "tts-1", "voice": "alloy", "input": "bad \\ud800 text"}'
    response = httpx.post(server.api + "/audio/speech", content=content, headers={"content-type": "application/json"})
    assert_envelope(response, 400, param="input", code="invalid_value")


def test_curl_bad_input_is_400_envelope(server: Server) -> None:
    result = subprocess.run(
        ["curl", "-sS", "-i", "-H", "Content-Type: application/json", "--data-binary",
         json.dumps(speech_body(voice="nobody")), server.api + "/audio/speech"],
        capture_output=True, timeout=HANG_S, check=True,
    )  # fmt: skip
    head, _, body = result.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert b"x-request-id: req_" in head.lower()
    assert json.loads(body)["error"]["param"] == "voice"


# --- oversized bodies ----------------------------------------------------------------------------


def test_30_mb_body_is_413_and_the_server_keeps_serving(server: Server, client: openai.OpenAI) -> None:
    before = server.speech_requests()
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.speech.create(model="tts-1", voice="alloy", input="a" * 30_000_000)
    assert_envelope(caught.value.response, 413)
    assert server.speech_requests() == before + 1
    ok = client.audio.speech.create(model="tts-1", voice="alloy", input="still here", response_format="pcm")
    assert len(ok.content) == 2 * TOTAL_SAMPLES


def test_chunked_oversized_body_is_413(server: Server) -> None:
    def body() -> Iterator[bytes]:
        for _ in range(30):  # 30 MiB in 1 MiB chunks, no Content-Length
            yield b"x" * 1_048_576

    with httpx.Client(timeout=HANG_S) as http:
        response = http.post(server.api + "/audio/speech", content=body(), headers={"content-type": "application/json"})
        assert_envelope(response, 413)
        assert http.post(server.api + "/audio/speech", json=speech_body(response_format="pcm")).status_code == 200


def test_curl_30_mb_body_is_413(server: Server, tmp_path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b'{"input": "' + b"a" * 30_000_000 + b'"}')
    result = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Content-Type: application/json",
         "--data-binary", f"@{big}", server.api + "/audio/speech"],
        capture_output=True, timeout=HANG_S,
    )  # fmt: skip
    assert result.stdout == b"413"
    assert httpx.get(server.url + "/health").status_code == 200


def test_error_retry_headers() -> None:
    from gateway.errors import APIError, RateLimitedError

    assert APIError(400, "bad").headers() == {"x-should-retry": "false"}
    assert APIError(503, "down").headers() == {"retry-after": "1", "retry-after-ms": "1000"}
    assert RateLimitedError("busy", retry_after=2.5).headers() == {"retry-after": "3", "retry-after-ms": "2500"}
    assert APIError(503, "down").body()["error"]["type"] == "server_error"


async def test_body_limit_stops_reading_a_chunked_body_early() -> None:
    """The middleware fails the read as soon as the count passes the limit: 2 of 30 chunks read."""
    from starlette.responses import JSONResponse

    from gateway.middleware import RequestContextMiddleware

    consumed = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal consumed
        consumed += 1
        return {"type": "http.request", "body": b"x" * 1_048_576, "more_body": consumed < 30}

    async def send(message: dict) -> None:
        sent.append(message)

    async def buffering_app(scope, receive, send) -> None:
        while (await receive())["more_body"]:
            pass
        await JSONResponse({"ok": True})(scope, receive, send)

    middleware = RequestContextMiddleware(buffering_app, body_limit=lambda path: 1_048_576)
    await middleware({"type": "http", "method": "POST", "path": "/v1/audio/speech", "headers": []}, receive, send)
    assert consumed == 2
    assert sent[0]["status"] == 413
    assert any(name == b"x-request-id" for name, _ in sent[0]["headers"])
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
