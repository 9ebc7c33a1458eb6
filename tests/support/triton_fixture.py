"""Start the real tritonserver on this repository's token2wav model with tiny random weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.serving.cpus import shared_machine_split
from backends.serving.triton import TritonServer
from backends.token2wav.service import parameter_env
from gateway.voices import Voice

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_REPOSITORY = REPO_ROOT / "model_repo_dit"


def write_tiny_token2wav(model_dir: Path, seed: int = 0) -> Path:
    """flow.yaml / flow.pt / hift.pt in the published formats, tiny and random."""
    from backends.token2wav.tiny import write_token2wav_dir

    write_token2wav_dir(model_dir, size="tiny", seed=seed)
    return model_dir


def start_token2wav_server(work_dir: Path, **parameters: object) -> TritonServer:
    """Write tiny weights under ``work_dir`` and start tritonserver; ``parameters`` override config.pbtxt."""
    model_dir = write_tiny_token2wav(work_dir / "token2wav")
    env = parameter_env(model_dir=model_dir, device="cpu", dtype="float32", **parameters)
    split = shared_machine_split()  # keep clear of the session's vLLM, which busy-polls its cores
    server = TritonServer(MODEL_REPOSITORY, env=env, work_dir=work_dir / "triton", startup_timeout_s=180,
                          cpu_cores=split[1] if split else None)
    return server.start()


def random_voice(seed: int, prompt_tokens: int = 12, lookahead_pad: str = "silence") -> Voice:
    """A voice with random conditioning (valid shapes and ranges) for tests."""
    rng = np.random.default_rng(seed)
    return Voice(
        id=f"test-voice-{seed}",
        name=f"test voice {seed}",
        prompt_text="",
        prompt_tokens=rng.integers(0, 6561, prompt_tokens).astype(np.int32),
        prompt_mel=(rng.standard_normal((2 * prompt_tokens, 80)) - 4.0).astype(np.float32),
        speaker_embedding=rng.standard_normal(192).astype(np.float32),
        lookahead_pad=lookahead_pad,
    )


def random_tokens(seed: int, count: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 6561, count).tolist()
