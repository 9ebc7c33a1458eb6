"""Structured logs: JSON lines carrying the request id (TTS_LOG_FORMAT / TTS_LOG_LEVEL, gateway/logs.py).

The app runs in-process under uvicorn (a thread) with the REAL pipeline: the real LLM client against
the trtllm-serve protocol peer (tests/support/trtllm_peer.py), and a token2wav address nobody listens
on, so a request runs the LLM producer task and then fails with a 503. The peer ends every utterance
before its min_tokens, which the LLM client logs from inside that producer task: a record logged deep
in the pipeline, by code that never sees the request id, must still carry it. The real stack's log
file is checked in tests/test_reliability_llm_faults.py.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from pydantic import SecretStr

from backends.llm.tiny import write_tiny_tokenizer
from backends.llm.vllm_launcher import free_port
from backends.voices.presets import write_builtin_voices
from gateway.app import build_synthesizer, create_app
from gateway.logs import UVICORN_LOGGERS, configure_logging
from gateway.middleware import JsonFormatter, RequestIdFilter, current_request_id
from gateway.settings import Settings
from tests.support.trtllm_peer import TrtllmPeer

HANG_S = 60
GOOD_KEY = "sk-logs-test-key-0123456789abcdef"
WRONG_KEY = "sk-logs-wrong-key-fedcba987654321"
FIELDS = {"time", "level", "logger", "message"}


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state: put it back for the tests that follow."""
    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    watched = [logging.getLogger(name) for name in (*UVICORN_LOGGERS, "httpx", "httpcore", "py.warnings")]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in watched]
    yield
    root.handlers[:] = saved_root[0]
    root.setLevel(saved_root[1])
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate
    logging.captureWarnings(False)


def json_lines(text: str) -> list[dict]:
    entries = []
    for line in text.splitlines():
        if line.strip():
            entry = json.loads(line)  # every line is one JSON object
            assert isinstance(entry, dict) and FIELDS <= entry.keys(), line
            entries.append(entry)
    return entries


def test_request_log_lines_are_json_and_carry_the_request_id_even_deep_in_the_pipeline(
    tmp_path: Path, restore_logging: None
) -> None:
    peer = TrtllmPeer(eos_after=2, honour_min_tokens=False).start()  # eos before min_tokens: a warning
    tokenizer_dir = write_tiny_tokenizer(tmp_path / "llm")
    write_builtin_voices(tmp_path / "voices")
    settings = Settings(
        llm_url=peer.base_url, llm_dialect="trtllm", llm_tokenizer_dir=str(tokenizer_dir),
        triton_url=f"127.0.0.1:{free_port()}", triton_timeout_s=10, voices_dir=str(tmp_path / "voices"),
        text_normalization=False, api_keys=SecretStr(GOOD_KEY), pool_health_interval_s=0,
        log_format="json", log_level="info",
    )  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings, build_synthesizer(settings)), log_level="info"))
    buffer = io.StringIO()
    configure_logging(settings.log_format, settings.log_level, stream=buffer)  # after uvicorn's own set-up
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_S
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        body = {"model": "tts-1", "voice": "alloy", "input": "Hello there, logs.", "response_format": "pcm"}
        failed = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=HANG_S,
                            headers={"authorization": f"Bearer {GOOD_KEY}"})
        refused = httpx.post(f"{url}/v1/audio/speech", json=body, timeout=HANG_S,
                             headers={"authorization": f"Bearer {WRONG_KEY}"})
    finally:
        server.should_exit = True
        thread.join(HANG_S)
        sock.close()
        peer.stop()
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "backend_unavailable", failed.text
    assert refused.status_code == 401
    request_id, refused_id = failed.headers["x-request-id"], refused.headers["x-request-id"]

    text = buffer.getvalue()
    entries = json_lines(text)
    assert any(e["logger"] == "uvicorn.error" and "Application startup complete" in e["message"] for e in entries)
    ids = {e["request_id"] for e in entries if "request_id" in e}
    assert ids <= {request_id, refused_id}  # nothing is tagged with a request it does not belong to
    mine = [e for e in entries if e.get("request_id") == request_id]
    loggers = {e["logger"] for e in mine}
    # Deep: the LLM client, inside the pipeline's producer task, knows nothing of the request id.
    assert "gateway.llm.client" in loggers, mine
    assert any("min_tokens" in e["message"] for e in mine if e["logger"] == "gateway.llm.client")
    assert "gateway.streaming" in loggers  # the 503 itself
    assert any(e["logger"] == "gateway.auth" and e.get("request_id") == refused_id for e in entries)
    assert GOOD_KEY not in text and WRONG_KEY not in text
    # Startup records (no request) carry no request_id at all.
    assert all("request_id" not in e for e in entries if e["logger"] == "uvicorn.error")


def test_exceptions_are_one_json_field_and_text_format_names_the_request(restore_logging: None) -> None:
    buffer = io.StringIO()
    configure_logging("json", "debug", stream=buffer)
    log = logging.getLogger("gateway.test")
    token = current_request_id.set("req_0123")
    try:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            log.exception("handling failed")
        log.debug("debug record")
    finally:
        current_request_id.reset(token)
    log.info("outside any request")
    first, second, third = json_lines(buffer.getvalue())
    assert first["level"] == "ERROR" and first["request_id"] == "req_0123" and first["message"] == "handling failed"
    assert "Traceback" in first["exception"] and "ValueError: boom" in first["exception"]
    assert second["level"] == "DEBUG" and second["request_id"] == "req_0123"
    assert "request_id" not in third and third["time"].endswith("+00:00")

    text = io.StringIO()
    configure_logging("text", "warning", stream=text)  # replaces the JSON handler, does not add one
    assert sum(type(h).__name__ == "GatewayLogHandler" for h in logging.getLogger().handlers) == 1
    token = current_request_id.set("req_4567")
    try:
        log.warning("something odd")
        log.info("below the level")
    finally:
        current_request_id.reset(token)
    lines = text.getvalue().splitlines()
    assert len(lines) == 1 and "WARNING gateway.test [req_4567] something odd" in lines[0]


def test_log_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_LOG_FORMAT", "TEXT")
    monkeypatch.setenv("TTS_LOG_LEVEL", "Warning")
    settings = Settings()
    assert (settings.log_format, settings.log_level) == ("text", "warning")
    assert Settings.model_fields["log_format"].default == "json"
    monkeypatch.setenv("TTS_LOG_FORMAT", "xml")
    with pytest.raises(ValueError):
        Settings()


def test_filter_keeps_an_explicit_request_id() -> None:
    record = logging.getLogger("gateway.test").makeRecord("gateway.test", logging.INFO, __file__, 1, "m", (), None,
                                                          extra={"request_id": "req_explicit"})
    token = current_request_id.set("req_context")
    try:
        assert RequestIdFilter().filter(record)
    finally:
        current_request_id.reset(token)
    assert json.loads(JsonFormatter().format(record))["request_id"] == "req_explicit"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
