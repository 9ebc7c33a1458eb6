"""The vLLM launcher's recipe, readiness wait and process-group cleanup, with a fake interpreter
standing in for vLLM (the real server is exercised by test_llm_vllm.py)."""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

from backends.llm.vllm_launcher import VLLMServer

# A fake "python": ignores its arguments, starts a child (like vLLM's engine core), records both pids,
# and serves 200 on /v1/models when READY=1 (otherwise it never becomes ready).
FAKE_SERVER = """#!{python}
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([{python!r}, "-c", "import time; time.sleep(600)"])
with open(os.environ["PIDS_FILE"], "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if os.environ.get("READY") == "1" else 503)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def fake_python(tmp_path: Path) -> Path:
    script = tmp_path / "fake-python"
    script.write_text(FAKE_SERVER.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists": check its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes still alive: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


def test_command_and_environment_follow_the_recipe(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, served_model_name="voice-llm", port=12345)
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in ("--dtype float32", "--max-model-len 2048", "--generation-config vllm", "--served-model-name voice-llm"):
        assert flag in joined
    env = server.environment()
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert server.base_url == "http://127.0.0.1:12345/v1"


def test_start_waits_for_models_and_stop_ends_the_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    monkeypatch.setenv("READY", "1")
    with VLLMServer(tmp_path, python=fake_python(tmp_path), startup_timeout_s=60) as server:
        assert server.running and server.startup_seconds is not None
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(alive(p) for p in pids)
    wait_dead(pids)


def test_startup_deadline_raises_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    monkeypatch.setenv("READY", "0")
    server = VLLMServer(tmp_path, python=fake_python(tmp_path), startup_timeout_s=5)
    with pytest.raises(TimeoutError):
        server.start()
    assert not server.running
    wait_dead([int(p) for p in pids_file.read_text().split()])


def test_die_with_parent_stops_the_server_when_its_starting_thread_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PIDS_FILE", str(pids_file))
    monkeypatch.setenv("READY", "1")
    server = VLLMServer(tmp_path, python=fake_python(tmp_path), startup_timeout_s=60, die_with_parent=True)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    server_pid = int(pids_file.read_text().split()[0])
    try:
        wait_dead([server_pid])  # the parent-death signal reached the server itself
    finally:
        server.stop()  # and stop() still cleans up the rest of its group
