"""Operations of the gateway without backends: admission control, timeouts, auth, /ready,
/metrics, request-id logs, and graceful shutdown of a real uvicorn process.

The app is served by uvicorn (in a thread; a subprocess for the SIGTERM test) over the controllable
double in tests/support/ops_double.py. No assertion is about timing; waits have generous deadlines.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from gateway.app import create_app
from gateway.auth import key_id, load_api_keys, mask_key
from gateway.errors import APIError
from gateway.pipeline import PreparedSpeech
from gateway.settings import Settings
from gateway.token2wav import Token2WavUnavailable
from tests.support.ops_double import CHUNK, CHUNKS, SLOW_CHUNKS, OpsSynthesizer

HANG_S = 30
REPO = Path(__file__).resolve().parents[1]
GOOD_KEY = "sk-ops-test-key-0123456789abcdef"
OTHER_KEY = "sk-ops-other-key-fedcba9876543210"
WRONG_KEY = "sk-wrong-key-not-configured-12345"


@contextmanager
def serve(settings: Settings, synth: OpsSynthesizer) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, synth), log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        synth.release_all()
        server.should_exit = True
        thread.join(HANG_S)
        sock.close()


def speech(text: str = "hello", **fields: object) -> dict:
    return {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", **fields}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metric(url: str, name: str, **labels: str) -> float:
    """A sample's value from /metrics (0 when the series does not exist yet)."""
    text = httpx.get(f"{url}/metrics", timeout=HANG_S).text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def assert_error(response: httpx.Response, status: int, code: str | None, type_: str) -> dict:
    assert response.status_code == status, response.text[:300]
    assert response.headers.get("x-request-id", "").startswith("req_")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["type"] == type_
    return body["error"]


@contextmanager
def held_streams(url: str, count: int, key: str | None = None) -> Iterator[list[httpx.Response]]:
    """``count`` streams that got their 200 and first bytes and stay open until the block ends."""
    client = httpx.Client(timeout=HANG_S, headers=auth(key) if key else None)
    streams = []
    try:
        for _ in range(count):
            cm = client.stream("POST", f"{url}/v1/audio/speech", json=speech("[hold]"))
            response = cm.__enter__()
            assert response.status_code == 200
            chunks = response.iter_raw()  # kept referenced: a collected iterator closes the response
            next(chunks)  # the first chunk arrived: the stream is in flight
            streams.append((cm, response, chunks))
        yield [r for _, r, _ in streams]
    finally:
        for cm, _, _ in streams:
            cm.__exit__(None, None, None)
        client.close()


# --- admission control ----------------------------------------------------------------------------


def test_streams_beyond_the_gateway_limit_get_429_with_retry_after_and_slots_come_back() -> None:
    synth = OpsSynthesizer()
    settings = Settings(max_concurrent_streams=2, admission_retry_after_s=3)
    with serve(settings, synth) as url:
        with held_streams(url, 2):
            refused = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
            error = assert_error(refused, 429, "rate_limit_exceeded", "invalid_request_error")
            assert "limit 2" in error["message"]
            assert refused.headers["retry-after"] == "3" and refused.headers["retry-after-ms"] == "3000"
            assert metric(url, "tts_active_streams") == 2
        # Closing the held streams frees their slots (client disconnect path).
        wait_until(lambda: metric(url, "tts_active_streams") == 0, "slots to be released")
        assert all(s.closed.is_set() for s in synth.prepared)
        for _ in range(3):  # more than the limit, one after another: none refused
            ok = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
            assert ok.status_code == 200 and len(ok.content) == 2 * CHUNK * CHUNKS
        assert metric(url, "tts_errors_total", type="rate_limited") == 1
        assert metric(url, "tts_active_streams") == 0


def test_per_key_limit_refuses_only_the_busy_key() -> None:
    synth = OpsSynthesizer()
    settings = Settings(max_concurrent_streams=10, max_streams_per_key=1, api_keys=f"{GOOD_KEY},{OTHER_KEY}")
    with serve(settings, synth) as url:
        with held_streams(url, 1, key=GOOD_KEY):
            busy = httpx.post(f"{url}/v1/audio/speech", json=speech(), headers=auth(GOOD_KEY), timeout=HANG_S)
            error = assert_error(busy, 429, "rate_limit_exceeded", "invalid_request_error")
            assert "API key" in error["message"] and GOOD_KEY not in busy.text
            other = httpx.post(f"{url}/v1/audio/speech", json=speech(), headers=auth(OTHER_KEY), timeout=HANG_S)
            assert other.status_code == 200
        wait_until(lambda: metric(url, "tts_active_streams") == 0, "slots to be released")
        again = httpx.post(f"{url}/v1/audio/speech", json=speech(), headers=auth(GOOD_KEY), timeout=HANG_S)
        assert again.status_code == 200


def test_openai_sdk_retries_a_429_and_then_succeeds() -> None:
    synth = OpsSynthesizer()
    settings = Settings(max_concurrent_streams=1, admission_retry_after_s=1)
    with serve(settings, synth) as url:
        with held_streams(url, 1):
            # Release the held stream once the SDK's first attempt was refused (its retry then fits).
            def release_after_refusal() -> None:
                wait_until(lambda: metric(url, "tts_errors_total", type="rate_limited") >= 1, "a 429")
                synth.release_all()

            releaser = threading.Thread(target=release_after_refusal, daemon=True)
            releaser.start()
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=HANG_S, max_retries=5)
            audio = sdk.audio.speech.create(model="tts-1", voice="alloy", input="hi", response_format="pcm")
            releaser.join(HANG_S)
        assert len(audio.content) == 2 * CHUNK * CHUNKS
        assert metric(url, "tts_errors_total", type="rate_limited") >= 1


def test_client_leaving_before_the_first_audio_cancels_prepare_at_once() -> None:
    synth = OpsSynthesizer()
    with serve(Settings(stream_idle_timeout_s=0, request_timeout_s=0), synth) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while prepare waits (no timeout set)
            httpx.post(f"{url}/v1/audio/speech", json=speech("[stall-prepare]"), timeout=0.5)
        assert synth.prepare_cancelled.wait(HANG_S), "prepare kept running after the client left"
        wait_until(lambda: metric(url, "tts_active_streams") == 0, "the slot to be released")
        assert metric(url, "tts_errors_total", type="cancelled") == 1
        assert httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S).status_code == 200


def test_token2wav_capacity_error_maps_to_429_and_outage_to_503() -> None:
    capacity = PreparedSpeech._as_api_error(
        Token2WavUnavailable("[token2wav:unavailable] capacity: 8 live streams (max_live_streams=8)"))
    assert isinstance(capacity, APIError) and capacity.status == 429 and capacity.headers()["retry-after"] == "1"
    down = PreparedSpeech._as_api_error(Token2WavUnavailable("failed to connect to all addresses"))
    assert isinstance(down, APIError) and down.status == 503 and "retry-after" in down.headers()


def test_idle_timeout_before_audio_is_a_504_envelope_and_frees_the_slot() -> None:
    synth = OpsSynthesizer()
    with serve(Settings(stream_idle_timeout_s=0.5), synth) as url:
        response = httpx.post(f"{url}/v1/audio/speech", json=speech("[stall]"), timeout=HANG_S)
        assert_error(response, 504, "timeout", "server_error")
        assert synth.prepared[-1].closed.is_set()
        assert metric(url, "tts_active_streams") == 0
        assert metric(url, "tts_errors_total", type="idle_timeout") == 1


def test_idle_timeout_mid_sse_stream_ends_with_an_error_event() -> None:
    synth = OpsSynthesizer()
    with serve(Settings(stream_idle_timeout_s=0.5), synth) as url:
        response = httpx.post(f"{url}/v1/audio/speech", json=speech("[stall-after]", stream_format="sse"),
                              timeout=HANG_S)
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert events[0]["type"] == "speech.audio.delta"
        assert events[-1]["type"] == "error" or "error" in events[-1]
        assert "timeout" in json.dumps(events[-1])
        wait_until(lambda: metric(url, "tts_active_streams") == 0, "the slot to be released")


def test_request_timeout_bounds_a_slow_stream() -> None:
    synth = OpsSynthesizer()
    with serve(Settings(request_timeout_s=1.0, stream_idle_timeout_s=0), synth) as url:
        with httpx.Client(timeout=HANG_S) as client:
            with client.stream("POST", f"{url}/v1/audio/speech", json=speech("[slow]")) as response:
                assert response.status_code == 200
                with pytest.raises(httpx.RemoteProtocolError):  # raw audio: truncated transfer, no final chunk
                    response.read()
        wait_until(lambda: metric(url, "tts_active_streams") == 0, "the slot to be released")
        assert metric(url, "tts_errors_total", type="request_timeout") == 1


# --- auth -----------------------------------------------------------------------------------------


def test_auth_401_envelopes_match_openai_and_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    synth = OpsSynthesizer()
    with serve(Settings(api_keys=GOOD_KEY), synth) as url:
        missing = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
        error = assert_error(missing, 401, None, "invalid_request_error")
        assert error["message"].startswith("You didn't provide an API key.")
        wrong = httpx.post(f"{url}/v1/audio/speech", json=speech(), headers=auth(WRONG_KEY), timeout=HANG_S)
        error = assert_error(wrong, 401, "invalid_api_key", "invalid_request_error")
        assert error["message"].startswith(f"Incorrect API key provided: {mask_key(WRONG_KEY)}.")
        assert WRONG_KEY not in wrong.text and WRONG_KEY[3:-4] not in wrong.text
        basic = httpx.get(f"{url}/v1/models", headers={"authorization": f"Basic {GOOD_KEY}"}, timeout=HANG_S)
        assert_error(basic, 401, None, "invalid_request_error")
        assert httpx.get(f"{url}/v1/models", headers=auth(GOOD_KEY), timeout=HANG_S).status_code == 200
        assert httpx.post(f"{url}/v1/audio/speech", json=speech(), headers=auth(GOOD_KEY),
                          timeout=HANG_S).status_code == 200
        # The SDK raises AuthenticationError for a 401 (and does not retry it).
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=WRONG_KEY, timeout=HANG_S)
        with pytest.raises(openai.AuthenticationError) as raised:
            sdk.models.list()
        assert raised.value.code == "invalid_api_key"
        # Probes and metrics stay open.
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=HANG_S).status_code == 200
        assert metric(url, "tts_errors_total", type="invalid_api_key") == 4
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert GOOD_KEY not in logged and WRONG_KEY not in logged
    assert "rejected" in caplog.text  # the rejections were logged, without the keys


def test_auth_off_without_keys_and_keys_from_a_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# operators\n{GOOD_KEY}\n\n{OTHER_KEY}\n")
    settings = Settings(api_keys_file=str(keys_file), api_keys="sk-env-key-000000000000",
                        metrics_require_auth=True)
    assert load_api_keys(settings) == ["sk-env-key-000000000000", GOOD_KEY, OTHER_KEY]
    assert key_id(GOOD_KEY) != key_id(OTHER_KEY) and GOOD_KEY not in key_id(GOOD_KEY)
    assert GOOD_KEY not in repr(settings)
    with serve(settings, OpsSynthesizer()) as url:
        assert httpx.get(f"{url}/v1/models", headers=auth(OTHER_KEY), timeout=HANG_S).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=HANG_S).status_code == 401
        assert httpx.get(f"{url}/metrics", headers=auth(GOOD_KEY), timeout=HANG_S).status_code == 200
        assert httpx.get(f"{url}/health", timeout=HANG_S).status_code == 200
    with serve(Settings(), OpsSynthesizer()) as url:  # no keys: auth off (local stack)
        assert httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S).status_code == 200


# --- observability --------------------------------------------------------------------------------


def test_ready_names_the_backend_that_is_down() -> None:
    synth = OpsSynthesizer(ready={"llm": True, "token2wav": False})
    with serve(Settings(), synth) as url:
        response = httpx.get(f"{url}/ready", timeout=HANG_S)
        assert response.status_code == 503 and "retry-after" in response.headers
        body = response.json()
        assert body["backends"] == {"llm": True, "token2wav": False} and "token2wav" in body["error"]
        assert httpx.get(f"{url}/health", timeout=HANG_S).json() == {"status": "ok"}
        synth.backends["token2wav"] = True
        assert httpx.get(f"{url}/ready", timeout=HANG_S).json() == {
            "status": "ok", "backends": {"llm": True, "token2wav": True}}


def test_metrics_record_latency_rtf_and_logs_carry_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    with serve(Settings(), OpsSynthesizer()) as url:
        response = httpx.post(f"{url}/v1/audio/speech", json=speech(), timeout=HANG_S)
        assert response.status_code == 200
        wait_until(lambda: metric(url, "tts_request_duration_seconds_count", outcome="ok") == 1, "the stream record")
        assert metric(url, "tts_time_to_first_audio_seconds_count") == 1
        assert metric(url, "tts_real_time_factor_count") == 1
        assert metric(url, "tts_audio_seconds_total") == pytest.approx(CHUNK * CHUNKS / 24_000)
        text = httpx.get(f"{url}/metrics", timeout=HANG_S).text
        for name in ("tts_llm_first_token_seconds", "tts_token2wav_chunk_seconds", "tts_active_streams"):
            assert f"# TYPE {name}" in text
    request_id = response.headers["x-request-id"]
    records = [r for r in caplog.records if r.name == "gateway.admission" and request_id in r.getMessage()]
    assert records and all(getattr(r, "request_id", None) == request_id for r in records)


def test_json_log_formatter_carries_the_request_id() -> None:
    from gateway.middleware import JsonFormatter, RequestIdFilter, current_request_id

    token = current_request_id.set("req_abc")
    try:
        record = logging.getLogger("gateway.test").makeRecord("gateway.test", logging.INFO, __file__, 1,
                                                             "hello %s", ("x",), None)
        assert RequestIdFilter().filter(record) and record.request_id == "req_abc"
        entry = json.loads(JsonFormatter().format(record))
    finally:
        current_request_id.reset(token)
    assert entry["request_id"] == "req_abc" and entry["message"] == "hello x" and entry["level"] == "INFO"


# --- graceful shutdown ----------------------------------------------------------------------------


def test_sigterm_drains_in_flight_streams_then_exits() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "TTS_SHUTDOWN_DRAIN_S": "20"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.support.ops_double:app", "--port", str(port),
         "--timeout-graceful-shutdown", "20", "--log-level", "info"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, "uvicorn to start")
        with httpx.Client(timeout=HANG_S) as client:
            with client.stream("POST", f"{url}/v1/audio/speech", json=speech("[slow]", stream_format="sse")) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert "speech.audio.delta" in first
                proc.send_signal(signal.SIGTERM)
                # New connections are refused while the stream drains.
                wait_until(lambda: not up(), "the listener to close")
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        deltas = [line for line in [first, *rest] if "speech.audio.delta" in line]
        assert len(deltas) == SLOW_CHUNKS  # the in-flight stream finished whole
        # uvicorn re-raises the signal once it shut down gracefully, so -SIGTERM is a clean exit here.
        assert proc.wait(HANG_S) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(HANG_S)
    output = proc.stdout.read() if proc.stdout else ""
    assert "Waiting for connections to close" in output
    assert "Application shutdown complete" in output  # the lifespan (drain, backend close) ran to its end


async def test_drain_waits_for_in_flight_streams_refuses_new_ones_and_honours_its_deadline() -> None:
    import asyncio

    from gateway.admission import AdmissionController

    admission = AdmissionController(max_total=4, max_per_key=0, retry_after_s=2)
    permit = admission.acquire("key_a")
    asyncio.get_running_loop().call_later(0.05, permit.release)
    assert await admission.drain(HANG_S) is True
    with pytest.raises(APIError) as refused:
        admission.acquire(None)
    assert refused.value.status == 503 and refused.value.code == "shutting_down"
    stuck = AdmissionController(max_total=4, max_per_key=0, retry_after_s=2)
    stuck.acquire(None)
    assert await stuck.drain(0.05) is False  # the deadline passed with a stream still in flight
    permit.release()  # idempotent: a second release changes nothing
    assert admission.active == 0 and not admission.per_key
