"""Backend faults on real servers: Triton (token2wav) is killed mid-stream and restarted.

The stream in flight ends cleanly (an SSE error event in the envelope shape, the error logged); while
Triton is down new requests get 503 with Retry-After and /ready names token2wav; once Triton is back
requests succeed again without restarting the gateway (its gRPC channel reconnects).

This module starts its own Triton and gateway (it kills them; the session's shared stack must stay
healthy for the other modules) beside the shared vLLM. Waits are generous hang deadlines only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.llm.vllm_launcher import free_port
from backends.serving.triton import TritonServer
from deploy.local.stack import ROOT, GatewayProcess, StackConfig, gateway_env, prepare_assets
from tests.support.vllm_fixture import shared_vllm

HANG_S = 180
LONG_INPUT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)


class FaultStack:
    def __init__(self, triton: TritonServer, gateway: GatewayProcess) -> None:
        self.triton, self.gateway = triton, gateway

    @property
    def url(self) -> str:
        return self.gateway.url

    def kill_triton(self) -> None:
        process = self.triton._process
        assert process is not None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(HANG_S)
        self.triton.stop()  # forget the dead process (closes its log)


@pytest.fixture(scope="module")
def faults() -> Iterator[FaultStack]:
    llm = shared_vllm()
    work = Path(tempfile.mkdtemp(prefix="tts-faults-"))
    cfg = StackConfig(var_dir=work, llm_dir=llm.model_dir, external_llm_url=llm.base_url,
                      llm_served_name=llm.model_name, gateway_port=free_port())
    (work / "logs").mkdir(parents=True, exist_ok=True)
    token2wav_dir, llm_dir, voices_dir = prepare_assets(cfg)
    triton = TritonServer(ROOT / "model_repo_dit", env={
        "TOKEN2WAV_MODEL_DIR": str(token2wav_dir.resolve()), "TOKEN2WAV_DEVICE": "cpu", "TOKEN2WAV_DTYPE": "float32",
    }, work_dir=work / "triton")
    env = gateway_env(cfg, llm_dir, voices_dir, llm.base_url, triton.grpc_url)
    env["TTS_TRITON_TIMEOUT_S"] = "30"
    gateway = GatewayProcess(cfg.host, cfg.gateway_port, env, log_path=work / "logs" / "gateway.log")
    try:
        triton.start()
        gateway.start(ready_timeout_s=HANG_S)
        yield FaultStack(triton, gateway)
    finally:
        gateway.stop()
        triton.stop()
        shutil.rmtree(work, ignore_errors=True)


def speech(**fields: object) -> dict:
    return {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm", **fields}


def sse_payloads(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_triton_killed_mid_stream_then_down_then_restarted(faults: FaultStack) -> None:
    url = faults.url
    # Healthy first.
    assert httpx.get(f"{url}/ready", timeout=HANG_S).status_code == 200
    assert httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S).status_code == 200

    # Kill Triton after the first audio of a long SSE stream.
    with httpx.Client(timeout=HANG_S) as client:
        with client.stream("POST", f"{url}/v1/audio/speech",
                           json=speech(input=LONG_INPUT, stream_format="sse")) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "speech.audio.delta" in first
            faults.kill_triton()
            rest = list(lines)  # must end (the server closes the stream), not hang
    events = sse_payloads(rest)
    assert events, "the stream ended without any event after the kill"
    last = events[-1]
    assert last["type"] == "error", last["type"]
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["type"] == "server_error"
    assert "data: [DONE]" not in rest

    # While Triton is down: 503 + Retry-After for new requests, /ready names token2wav.
    down = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
    assert down.status_code == 503, down.text[:300]
    assert down.headers["retry-after"] and down.json()["error"]["code"] == "backend_unavailable"
    ready = httpx.get(f"{url}/ready", timeout=HANG_S)
    assert ready.status_code == 503 and ready.json()["backends"]["token2wav"] is False
    assert "token2wav" in ready.json()["error"] and ready.json()["backends"]["llm"] is True

    # Restart Triton on the same ports; the same gateway process serves again.
    gateway_pid = faults.gateway.proc.pid if faults.gateway.proc else None
    faults.triton.start()
    deadline = time.monotonic() + HANG_S
    while True:
        again = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
        if again.status_code == 200:
            break
        assert again.status_code == 503, again.text[:300]
        assert time.monotonic() < deadline, "the gateway did not recover after Triton came back"
        time.sleep(0.5)
    assert len(again.content) > 0
    assert httpx.get(f"{url}/ready", timeout=HANG_S).status_code == 200
    assert faults.gateway.proc is not None and faults.gateway.proc.pid == gateway_pid
    assert faults.gateway.proc.poll() is None
    log = Path(faults.gateway.log_path).read_text(errors="replace")
    assert "synthesis failed after streaming began" in log


def test_dead_backends_give_503_with_retry_after_and_ready_names_them(tmp_path: Path) -> None:
    """The real pipeline (real LLM and Triton clients) pointed at ports nobody listens on: no 500,
    no hang: 503 ``backend_unavailable`` with Retry-After, and /ready says which backends are down.
    Cheap: no server is started."""
    import threading

    import uvicorn

    from backends.llm.tiny import write_tiny_tokenizer
    from backends.voices.presets import write_builtin_voices
    from gateway.app import build_synthesizer, create_app
    from gateway.settings import Settings

    tokenizer_dir = write_tiny_tokenizer(tmp_path / "llm")
    write_builtin_voices(tmp_path / "voices")
    settings = Settings(llm_url=f"http://127.0.0.1:{free_port()}/v1", llm_tokenizer_dir=str(tokenizer_dir),
                        llm_dialect="vllm", triton_url=f"127.0.0.1:{free_port()}", voices_dir=str(tmp_path / "voices"),
                        llm_timeout_s=10, triton_timeout_s=10)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings, build_synthesizer(settings)), port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_S
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        ready = httpx.get(f"{url}/ready", timeout=HANG_S)
        assert ready.status_code == 503 and ready.headers["retry-after"]
        assert ready.json()["backends"] == {"llm": False, "token2wav": False}
        assert "llm" in ready.json()["error"] and "token2wav" in ready.json()["error"]
        for stream_format in ("audio", "sse"):
            response = httpx.post(f"{url}/v1/audio/speech", json=speech(stream_format=stream_format), timeout=HANG_S)
            assert response.status_code == 503, response.text[:300]
            assert response.headers["retry-after"] and response.json()["error"]["code"] == "backend_unavailable"
        metrics = httpx.get(f"{url}/metrics", timeout=HANG_S).text
        assert 'tts_errors_total{type="backend_unavailable"} 2.0' in metrics
        assert "tts_active_streams 0.0" in metrics
    finally:
        server.should_exit = True
        thread.join(HANG_S)
