"""One custom voice through the real stack: upload → speak (LLM prompt + token2wav on Triton) → delete.

The local stack makes tiny ONNX voice encoder models beside its tiny token2wav and points the
gateway at them (``deploy/local/stack.py``), exactly as ``make run`` does, so this is the path a
user takes. The stack is the process-wide shared one (tests/support/stack_fixture.py).
"""

from __future__ import annotations

import io

import av
import httpx
import numpy as np
import openai
import pytest

from deploy.local.stack import GatewayProcess
from tests.support.stack_fixture import stack  # noqa: F401  (pytest fixture: ONE stack per process)

SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz


def sample_wav(seconds: float = 3.0) -> bytes:
    rate = 24_000
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(150 + 25 * np.sin(2 * np.pi * 0.5 * t)) / rate
    pcm = (0.15 * sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((pcm * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


def test_custom_voice_through_the_real_stack(stack: GatewayProcess) -> None:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="local", timeout=300, max_retries=0) as client:
        wav = sample_wav()
        consent = client.audio.voice_consents.create(name="Speaker", language="en-US", recording=("c.wav", wav, "audio/wav"))
        voice = client.audio.voices.create(
            name="Speaker", consent=consent.id, audio_sample=wav, extra_body={"transcript": "A short prompt."}
        )
        assert voice.id.startswith("voice_") and voice.type == "audio_sample"

        pcm = client.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hello world.", response_format="pcm").read()
        assert len(pcm) > 0 and len(pcm) % (2 * SAMPLES_PER_TOKEN) == 0  # whole speech tokens of int16 audio
        assert np.abs(np.frombuffer(pcm, np.int16)).max() > 0

        assert client.audio.voices.delete(voice.id).deleted is True
        response = httpx.post(
            f"{stack.url}/v1/audio/speech", json={"model": "tts-1", "voice": {"id": voice.id}, "input": "Hi."}, timeout=300
        )
        assert response.status_code == 404 and response.json()["error"]["param"] == "voice"
        with pytest.raises(openai.NotFoundError):
            client.audio.voices.delete(voice.id)
