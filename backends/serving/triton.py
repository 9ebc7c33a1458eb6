"""Start and stop a real ``tritonserver`` from the ``nvidia-pytriton`` wheel (tests and the local stack).

The wheel ships the server binary, its shared libraries and the python backend, but the backend
directory inside site-packages lacks the stub for our interpreter and may be read-only, so we build a
writable backend directory (``python/`` = the backend library + utils + the matching
``python_backend_stubs/<X.Y>/triton_python_backend_stub``). The stub runs models with the interpreter
of the virtualenv that is active when the server starts; we activate the current one (``sys.prefix``)
so models import this project and its numpy<2.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Sequence

from backends.serving.cpus import pin_to


class TritonLaunchError(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    """Where the wheel put the server pieces."""

    root: Path
    """``.../site-packages/pytriton/tritonserver``"""
    libs: Path
    """``.../site-packages/nvidia_pytriton.libs`` (LD_LIBRARY_PATH)"""

    @property
    def binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    def stub(self, python_version: str | None = None) -> Path:
        version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"


def find_triton() -> TritonInstall:
    """Locate the wheel's server without importing ``pytriton`` (installed --no-deps, its imports fail)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonLaunchError("nvidia-pytriton is not installed in this environment (pip install --no-deps nvidia-pytriton)")
    package = Path(next(iter(spec.submodule_search_locations)))
    install = TritonInstall(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")
    if not install.binary.exists():
        raise TritonLaunchError(f"no tritonserver binary at {install.binary}")
    return install


def prepare_backend_dir(target: Path, install: TritonInstall | None = None) -> Path:
    """Make ``target/python`` a complete python backend for this interpreter; returns ``target``."""
    install = install or find_triton()
    stub = install.stub()
    if not stub.exists():
        raise TritonLaunchError(f"no python backend stub for Python {sys.version_info[:2]} at {stub}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = [p for p in (install.root / "backends" / "python").iterdir() if p.is_file()] + [stub]
    for source in sources:
        dest = python_dir / source.name
        if not dest.exists() or dest.stat().st_size != source.stat().st_size:
            tmp = dest.with_suffix(dest.suffix + ".tmp")
            shutil.copy2(source, tmp)
            os.replace(tmp, dest)
    return target


def free_port() -> int:
    """An ephemeral port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(install: TritonInstall, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment that makes the stub import this virtualenv: VIRTUAL_ENV, PATH, LD_LIBRARY_PATH."""
    env = dict(os.environ)
    env["VIRTUAL_ENV"] = sys.prefix
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", "")])
    lib_dirs = [str(install.libs), sysconfig.get_config_var("LIBDIR") or "", env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(d for d in lib_dirs if d)
    env.pop("PYTHONHOME", None)
    env.update(extra or {})
    return env


class TritonServer:
    """One ``tritonserver`` process serving a model repository.

    >>> with TritonServer("model_repo_dit", env={"TOKEN2WAV_MODEL_DIR": "..."}) as server:
    ...     server.grpc_url   # "127.0.0.1:PORT" for tritonclient.grpc(.aio)

    Ports default to free ephemeral ones. ``env`` is added to the server's environment (models read
    their parameter overrides from it). The log goes to ``log_path`` (``log_text()`` reads it); without
    ``work_dir`` a temporary one is made and removed by ``cleanup()`` (and on leaving the context).
    """

    def __init__(
        self,
        model_repository: str | os.PathLike,
        *,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        backend_dir: str | os.PathLike | None = None,
        work_dir: str | os.PathLike | None = None,
        startup_timeout_s: float = 120.0,
        extra_args: Sequence[str] = (),
        cpu_cores: Collection[int] | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.env = dict(env or {})
        self.host = host
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args)
        self.cpu_cores = cpu_cores
        """Cores the server and its python stubs are pinned to (see backends/serving/cpus.py)."""
        self._owned_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="triton-"))
        self.backend_dir = Path(backend_dir) if backend_dir else self.work_dir / "backends"
        self.log_path = self.work_dir / "tritonserver.log"
        self._process: subprocess.Popen | None = None
        self._log_file = None

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={self.backend_dir}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--strict-readiness=true",
            "--exit-timeout-secs=10",
            "--log-verbose=0",
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        """Start the server and wait until it and its models are ready (raises with the log tail)."""
        if self._process is not None:
            raise TritonLaunchError("server already started")
        install = find_triton()
        prepare_backend_dir(self.backend_dir, install)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        self._process = subprocess.Popen(
            self.command(install),
            env=server_env(install, {**self._thread_env(), **self.env}),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() can reach the python stubs too
            preexec_fn=pin_to(self.cpu_cores),
        )
        atexit.register(self.stop)  # a crashed test session or script must not leave a server behind
        try:
            self.wait_ready(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _thread_env(self) -> dict[str, str]:
        """torch threads = pinned cores (an explicit OMP_NUM_THREADS in ``env`` wins)."""
        return {"OMP_NUM_THREADS": str(len(self.cpu_cores))} if self.cpu_cores else {}

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise TritonLaunchError(f"tritonserver exited (code {code}) during start-up:\n{self.log_errors()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise TritonLaunchError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_errors()}\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (graceful: models' finalize runs), then SIGKILL our process group if it hangs."""
        process, self._process = self._process, None
        atexit.unregister(self.stop)
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:  # stubs are children of the server, in the group start_new_session made
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_errors(self, limit: int = 20) -> str:
        """Error lines of the log (model load failures come long before the shutdown noise at the end)."""
        errors = [line for line in self.log_text().splitlines() if line.startswith("E") or "error" in line.lower()]
        return "\n".join(errors[:limit]) or self.log_tail()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def cleanup(self) -> None:
        """Stop and remove the work dir if we created it."""
        self.stop()
        if self._owned_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()
