"""The local stack (Triton + gateway beside the shared vLLM), ONE per pytest process.

Starting Triton and the gateway costs tens of seconds of a 2-core machine, so like
tests/support/vllm_fixture.py this is a process-wide singleton: every test module that asks for the
``stack`` fixture (imported from here, or seen through tests/conftest.py) gets the same servers, even
though pytest keeps one session-fixture instance per module that imports it. It is stopped at exit.

Use it from a test module with::

    from tests.support.stack_fixture import stack  # noqa: F401  (pytest fixture)

    def test_x(stack): ...  # stack: deploy.local.stack.GatewayProcess
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from backends.llm.vllm_launcher import free_port
from deploy.local.stack import GatewayProcess, StackConfig, local_stack
from tests.support.vllm_fixture import shared_vllm

_lock = threading.Lock()
_exit_stack: contextlib.ExitStack | None = None
_gateway: GatewayProcess | None = None
_workdir: Path | None = None


def shared_stack() -> GatewayProcess:
    """Start (once per process) and return the stack's gateway process."""
    global _exit_stack, _gateway, _workdir
    with _lock:
        if _gateway is not None:
            if _gateway.proc is not None and _gateway.proc.poll() is not None:
                raise RuntimeError(f"the shared stack's gateway died; see the logs in {_workdir}")
            return _gateway
        llm = shared_vllm()
        _workdir = Path(tempfile.mkdtemp(prefix="tts-stack-"))
        cfg = StackConfig(
            var_dir=_workdir,
            llm_dir=llm.model_dir,
            external_llm_url=llm.base_url,
            llm_served_name=llm.model_name,
            gateway_port=free_port(),
            triton_http_port=free_port(),
            triton_grpc_port=free_port(),
            triton_metrics_port=free_port(),
        )
        exit_stack = contextlib.ExitStack()
        # Registered before starting: a failed start still stops whatever came up.
        atexit.register(_stop_shared)
        _exit_stack = exit_stack
        _gateway = exit_stack.enter_context(local_stack(cfg))
        return _gateway


def _stop_shared() -> None:
    global _exit_stack, _gateway
    exit_stack, _exit_stack, _gateway = _exit_stack, None, None
    if exit_stack is not None:
        exit_stack.close()
    if _workdir is not None:
        shutil.rmtree(_workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def stack() -> GatewayProcess:
    """The shared stack's gateway (``.url``, ``.env`` with TTS_TRITON_URL / TTS_LLM_URL)."""
    return shared_stack()
