"""Custom voices and consents through the real app, the real store and the real encoder code.

The ONNX models are tiny ones with the real signatures (``backends.voices.tiny_onnx``), made per
module; the synthesizer is a double that resolves ``voice`` through the app's ``VoiceRegistry`` (so
the store is consulted exactly as the pipeline does) and records what it got. Persistence and
sharing are checked with separate gateway processes: a restart on the local directory store, and
two processes on one real ``redis-server``.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import uvicorn

from backends.voices.encoder import VoiceEncoder
from backends.voices.tiny_onnx import write_tiny_encoder_models
from gateway.app import create_app
from gateway.audio_decode import decode_upload, sniff_format
from gateway.settings import Settings
from gateway.synth import SpeechJob, Usage
from gateway.voices import Voice, VoiceRegistry

HANG_S = 60
REPO = Path(__file__).resolve().parents[1]


# --- audio fixtures ----------------------------------------------------------------------------------


def speechlike(seconds: float, rate: int = 24_000, seed: int = 0) -> np.ndarray:
    """A voiced-sounding signal: harmonics of a wandering pitch under a syllable-rate envelope."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * x * envelope + 0.005 * rng.standard_normal(t.size)).astype(np.float32)


#: container → (PyAV format, codec)
CONTAINERS = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mpeg": ("mp3", "libmp3lame"),
    "ogg": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "webm": ("webm", "libopus"),
    "mp4": ("mp4", "aac"),
}


def encode_audio(pcm: np.ndarray, container: str, rate: int = 24_000) -> bytes:
    fmt, codec = CONTAINERS[container]
    if codec == "libopus":
        rate_out = 48_000
    else:
        rate_out = rate
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate_out)
        stream.layout = "mono"
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate_out)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="flt", layout="mono")
        frame.sample_rate = rate
        frames = resampler.resample(frame) + resampler.resample(None)
        for f in frames:
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def sample_wav() -> bytes:
    return encode_audio(speechlike(2.5), "wav")


# --- the app under test -------------------------------------------------------------------------------


@dataclass
class RecordedSpeech:
    job: SpeechJob
    voice: Voice
    usage: Usage

    async def pcm(self):
        yield np.full(2 * self.voice.prompt_tokens.size * 480, 0.1, np.float32)  # 2 mel frames per token


class VoiceEchoSynthesizer:
    """Resolves the voice like the pipeline does and answers with audio whose length encodes it."""

    def __init__(self, voices_dir: Path) -> None:
        self.voices = VoiceRegistry(voices_dir)
        self.prepared: list[RecordedSpeech] = []

    async def prepare(self, job: SpeechJob) -> RecordedSpeech:
        voice = await self.voices.resolve(job.voice)
        speech = RecordedSpeech(job, voice, Usage(input_tokens=1))
        self.prepared.append(speech)
        return speech


@dataclass
class Served:
    url: str
    synth: VoiceEchoSynthesizer

    @property
    def api(self) -> str:
        return self.url + "/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_encoder_models(tmp_path_factory.mktemp("encoder"), seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, encoder_dir: Path) -> Iterator[Served]:
    voices_dir = tmp_path_factory.mktemp("voices")
    settings = Settings(voices_dir=str(voices_dir), voice_encoder_dir=str(encoder_dir), voice_cache_size=4)
    synth = VoiceEchoSynthesizer(voices_dir)
    app = create_app(settings, synth)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Served(f"http://127.0.0.1:{sock.getsockname()[1]}", synth)
    uv.should_exit = True
    thread.join(HANG_S)
    sock.close()


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.api, api_key="sk-test", timeout=HANG_S, max_retries=0) as sdk:
        yield sdk


def make_consent(client: openai.OpenAI, wav: bytes, name: str = "Ada") -> str:
    consent = client.audio.voice_consents.create(name=name, language="en-US", recording=("consent.wav", wav, "audio/wav"))
    return consent.id


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


# --- tests ---------------------------------------------------------------------------------------------


def test_sniffing_and_decoding_every_container() -> None:
    pcm = speechlike(2.0)
    for container in CONTAINERS:
        data = encode_audio(pcm, container)
        assert sniff_format(data) == container, container
        decoded = decode_upload(data)
        assert abs(decoded.duration_s - 2.0) < 0.1, (container, decoded.duration_s)
        assert abs(decoded.pcm_24k.size / 24_000 - decoded.duration_s) < 0.01
    assert sniff_format(b"%PDF-1.7 not audio") is None


def test_consent_crud_and_cursor_paging(client: openai.OpenAI, sample_wav: bytes) -> None:
    created = client.audio.voice_consents.create(name="Grace", language="en-GB", recording=sample_wav)
    assert created.object == "audio.voice_consent" and created.id.startswith("cons_") and len(created.id) == 37
    assert created.name == "Grace" and created.language == "en-GB" and abs(created.created_at - time.time()) < 600
    assert client.audio.voice_consents.retrieve(created.id) == created
    updated = client.audio.voice_consents.update(created.id, name="Grace H.")
    assert updated.name == "Grace H." and updated.created_at == created.created_at
    others = [make_consent(client, sample_wav, name=f"p{i}") for i in range(4)]
    first = client.audio.voice_consents.list(limit=2)
    assert [c.id for c in first.data][:1] and first.has_more is True
    everything = [c.id for c in client.audio.voice_consents.list(limit=2)]  # auto-paging follows `after`
    assert everything[-5:] == [created.id, *others] and len(everything) == len(set(everything))
    raw = httpx.get(f"{client.base_url}audio/voice_consents", params={"limit": 2, "after": others[1]}).json()
    assert raw["object"] == "list" and [c["id"] for c in raw["data"]] == others[2:]
    assert raw["first_id"] == others[2] and raw["last_id"] == others[3] and raw["has_more"] is False
    deleted = client.audio.voice_consents.delete(created.id)
    assert deleted.id == created.id and deleted.deleted is True and deleted.object == "audio.voice_consent"
    with pytest.raises(openai.NotFoundError):
        client.audio.voice_consents.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.audio.voice_consents.delete(created.id)
    for bad_limit in (0, 101):
        r = httpx.get(f"{client.base_url}audio/voice_consents", params={"limit": bad_limit})
        assert r.status_code == 400 and error_of(r)["param"] == "limit"


def test_consent_validation(client: openai.OpenAI, sample_wav: bytes) -> None:
    with pytest.raises(openai.BadRequestError) as bad_language:
        client.audio.voice_consents.create(name="x", language="english please", recording=sample_wav)
    assert bad_language.value.body["param"] == "language"
    with pytest.raises(openai.BadRequestError) as not_audio:
        client.audio.voice_consents.create(name="x", language="en", recording=b"hello, this is text" * 10)
    assert not_audio.value.body["param"] == "recording"


def test_create_voice_speak_and_delete(client: openai.OpenAI, served: Served, sample_wav: bytes, encoder_dir: Path) -> None:
    consent = make_consent(client, sample_wav)
    voice = client.audio.voices.create(
        name="Ada", consent=consent, audio_sample=("ada.wav", sample_wav, "audio/wav"),
        extra_body={"transcript": "Hello there."},
    )
    assert voice.object == "audio.voice" and voice.id.startswith("voice_") and voice.type == "audio_sample"
    assert voice.name == "Ada" and abs(voice.created_at - time.time()) < 600

    audio = client.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hi.", response_format="pcm").read()
    used = served.synth.prepared[-1].voice
    assert used.id == voice.id and used.prompt_text == "Hello there."
    assert len(audio) == 2 * 2 * used.prompt_tokens.size * 480  # int16 PCM of the double's voice-length audio
    # The stored voice is exactly what the encoder computes from the same bytes.
    decoded = decode_upload(sample_wav)
    expected = VoiceEncoder(encoder_dir).encode(decoded.pcm_16k, decoded.pcm_24k)
    np.testing.assert_array_equal(used.prompt_tokens, expected.prompt_tokens)
    np.testing.assert_array_equal(used.prompt_mel, expected.prompt_mel)
    np.testing.assert_array_equal(used.speaker_embedding, expected.speaker_embedding)
    assert used.model_hash == expected.model_hash and used.extra["consent"] == consent
    assert 2 * used.prompt_tokens.size == used.prompt_mel.shape[0] and abs(used.prompt_tokens.size - 2.5 * 25) <= 2

    listing = httpx.get(f"{served.api}/audio/voices", params={"limit": 100}).json()
    assert listing["object"] == "list" and voice.id in [v["id"] for v in listing["data"]]

    deleted = client.audio.voices.delete(voice.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (voice.id, "audio.voice.deleted", True)
    with pytest.raises(openai.NotFoundError) as gone:
        client.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hi.")
    assert gone.value.body["param"] == "voice"
    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete(voice.id)


def test_create_voice_from_raw_bytes_of_every_container(client: openai.OpenAI, sample_wav: bytes) -> None:
    consent = make_consent(client, sample_wav)
    pcm = speechlike(1.6, seed=1)
    for container in CONTAINERS:
        voice = client.audio.voices.create(name=container, consent=consent, audio_sample=encode_audio(pcm, container))
        assert voice.id.startswith("voice_") and voice.name == container


@pytest.mark.parametrize(
    "audio, why",
    [
        (lambda: encode_audio(np.zeros(48_000, np.float32), "wav"), "silent"),
        (lambda: encode_audio(speechlike(0.5), "wav"), "too short"),
        (lambda: encode_audio(speechlike(31.0), "flac"), "too long"),
        (lambda: encode_audio(speechlike(2.0), "wav")[:60] + os.urandom(4000), "corrupt"),
        (lambda: b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(3000), "corrupt header"),
        (lambda: b"just some text, not audio at all" * 50, "not audio"),
    ],
)
def test_bad_samples_are_400(client: openai.OpenAI, sample_wav: bytes, audio, why: str) -> None:
    consent = make_consent(client, sample_wav)
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.voices.create(name="x", consent=consent, audio_sample=("x.wav", audio(), "audio/wav"))
    assert err.value.status_code == 400 and err.value.body["param"] == "audio_sample", why


def test_unknown_consent_and_bad_ids(client: openai.OpenAI, served: Served, sample_wav: bytes) -> None:
    for consent in ("cons_" + "0" * 32, "../../etc/passwd", "cons_XYZ"):
        with pytest.raises(openai.BadRequestError) as err:
            client.audio.voices.create(name="x", consent=consent, audio_sample=sample_wav)
        assert err.value.body["param"] == "consent"
    for voice_id in ("voice_" + "0" * 32, "voice_..%2F..%2Fx", "voice_ABC"):
        r = httpx.delete(f"{served.api}/audio/voices/{voice_id}", headers={"content-type": "application/json"})
        assert r.status_code == 404 and error_of(r)["type"] == "invalid_request_error"
    r = httpx.post(f"{served.api}/audio/speech", json={"model": "tts-1", "input": "x", "voice": {"id": "../x"}})
    assert r.status_code == 404 and error_of(r)["param"] == "voice"


def test_oversized_sample_is_rejected(client: openai.OpenAI, sample_wav: bytes) -> None:
    consent = make_consent(client, sample_wav)
    with pytest.raises(openai.APIStatusError) as err:
        client.audio.voices.create(name="big", consent=consent, audio_sample=sample_wav + bytes(10 * 1024 * 1024))
    assert err.value.status_code == 413


# --- separate gateway processes: restart (local store) and two replicas on one Redis ------------------

GATEWAY = textwrap.dedent(
    """
    import sys, uvicorn
    sys.path.insert(0, {tests!r})
    from test_voices_api import VoiceEchoSynthesizer
    from gateway.app import create_app
    from gateway.settings import Settings
    settings = Settings()
    app = create_app(settings, VoiceEchoSynthesizer(settings.voices_dir))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    """
)


class GatewayProc:
    def __init__(self, env: dict[str, str]) -> None:
        self.port = free_port()
        code = GATEWAY.format(tests=str(REPO / "tests"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.port)], env={**os.environ, **env}, cwd=REPO, start_new_session=True
        )
        self.api = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + HANG_S
        while True:
            assert self.proc.poll() is None, "gateway process exited"
            assert time.monotonic() < deadline, "gateway did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.api, api_key="sk-test", timeout=HANG_S, max_retries=0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(HANG_S)


def speak_pcm_bytes(client: openai.OpenAI, voice_id: str) -> int:
    return len(client.audio.speech.create(model="tts-1", voice={"id": voice_id}, input="Hi.", response_format="pcm").read())


def test_voices_survive_a_gateway_restart(tmp_path: Path, encoder_dir: Path, sample_wav: bytes) -> None:
    env = {"TTS_VOICES_DIR": str(tmp_path / "voices"), "TTS_VOICE_ENCODER_DIR": str(encoder_dir)}
    first = GatewayProc(env)
    try:
        with first.client() as c:
            consent = make_consent(c, sample_wav)
            voice = c.audio.voices.create(name="Kept", consent=consent, audio_sample=sample_wav)
            before = speak_pcm_bytes(c, voice.id)
    finally:
        first.stop()
    assert (tmp_path / "voices" / "custom" / "voices" / f"{voice.id}.npz").is_file()
    second = GatewayProc(env)
    try:
        with second.client() as c:
            assert speak_pcm_bytes(c, voice.id) == before > 0
            assert c.audio.voice_consents.retrieve(consent).name == "Ada"
            c.audio.voices.delete(voice.id)
            with pytest.raises(openai.NotFoundError):
                c.audio.voices.delete(voice.id)
    finally:
        second.stop()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = shutil.which("redis-server")
    assert server, "redis-server is installed by deploy/local/setup.sh"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + HANG_S
    while True:
        assert proc.poll() is None, "redis-server exited"
        assert time.monotonic() < deadline, "redis-server did not start"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(HANG_S)


def test_two_gateways_share_voices_through_redis(tmp_path: Path, encoder_dir: Path, redis_url: str, sample_wav: bytes) -> None:
    base = {"TTS_VOICE_STORE": "redis", "TTS_REDIS_URL": redis_url, "TTS_VOICE_ENCODER_DIR": str(encoder_dir)}
    a = GatewayProc({**base, "TTS_VOICES_DIR": str(tmp_path / "a")})
    b = GatewayProc({**base, "TTS_VOICES_DIR": str(tmp_path / "b")})
    try:
        with a.client() as ca, b.client() as cb:
            consent = make_consent(ca, sample_wav)
            assert cb.audio.voice_consents.retrieve(consent).id == consent
            voice = cb.audio.voices.create(name="Shared", consent=consent, audio_sample=("s.wav", sample_wav))
            n = speak_pcm_bytes(ca, voice.id)
            assert n > 0 and speak_pcm_bytes(cb, voice.id) == n  # both cache it now
            assert voice.id in [v["id"] for v in httpx.get(f"{a.api}/audio/voices").json()["data"]]
            ca.audio.voices.delete(voice.id)
            with pytest.raises(openai.NotFoundError):  # b's cached copy is not used after a's delete
                speak_pcm_bytes(cb, voice.id)
            with pytest.raises(openai.NotFoundError):
                cb.audio.voices.delete(voice.id)
            assert not any(p.is_dir() for p in (tmp_path / "a" / "custom", tmp_path / "b" / "custom"))
    finally:
        a.stop()
        b.stop()
