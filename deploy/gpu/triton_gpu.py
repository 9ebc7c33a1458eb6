"""token2wav on a GPU through a real ``tritonserver`` (the nvidia-pytriton wheel's binary), for benchmarks.

The GPU benchmark machine has PyTorch and a GPU but no Triton, no registry and a 64 MiB carry limit, so
``deploy/gpu/run.sh`` unpacks a slimmed copy of the wheel's server (binary, python backend, the Python
3.12 stub, its shared libraries) and a few wheels (numpy<2 for the stub, tritonclient, pydantic ...).
This module then:

- writes a full-size random-weight Step-Audio2 ``token2wav/`` folder (published file layout);
- makes a GPU copy of ``model_repo_dit`` (``instance_group`` KIND_GPU, device cuda, a half dtype,
  room for many live streams) and starts ``tritonserver`` on it with ``backends.serving.triton``.

    python -m deploy.gpu.triton_gpu --work /tmp/t2w --dtype float16 [--probe]

``--probe`` streams one utterance through gRPC (the gateway's client) and prints per-chunk latency:
a smoke check that the whole path works on the GPU before longer benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np

from backends.serving.triton import TritonServer
from backends.token2wav.service import parameter_env

ROOT = Path(__file__).resolve().parents[2]


def gpu_model_repo(target: Path, *, max_live_streams: int = 128, max_batch_size: int = 16,
                   max_candidates: int = 160, queue_delay_us: int = 0, instances: int = 1) -> Path:
    """A copy of model_repo_dit whose config runs one instance on GPU 0."""
    source = ROOT / "model_repo_dit"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "token2wav_dit" / "config.pbtxt"
    text = config.read_text()
    text = re.sub(r"instance_group \[.*?\]\n", f"instance_group [ {{ count: {instances} kind: KIND_GPU gpus: [ 0 ] }} ]\n",
                  text, flags=re.S)
    text = re.sub(r"max_batch_size: \d+", f"max_batch_size: {max_batch_size}", text)
    text = re.sub(r"max_candidate_sequences: \d+", f"max_candidate_sequences: {max_candidates}", text)
    text = re.sub(r"preferred_batch_size: \[ \d+ \]", f"preferred_batch_size: [ {max_batch_size} ]", text)
    text = re.sub(r"max_queue_delay_microseconds: \d+", f"max_queue_delay_microseconds: {queue_delay_us}", text)
    config.write_text(text)
    return target


def start_gpu_triton(work: Path, model_dir: Path, dtype: str, max_live_streams: int = 128,
                     max_batch_size: int = 16, extra_env: dict[str, str] | None = None,
                     queue_delay_us: int = 0, instances: int = 1) -> TritonServer:
    repo = gpu_model_repo(work / "model_repo", max_live_streams=max_live_streams, max_batch_size=max_batch_size,
                          queue_delay_us=queue_delay_us, instances=instances)
    env = parameter_env(model_dir=model_dir.resolve(), device="cuda", dtype=dtype,
                        max_live_streams=max_live_streams, voice_cache_size=16)
    env.update(extra_env or {})
    server = TritonServer(repo, env=env, work_dir=work / "triton", startup_timeout_s=600)
    return server.start()


async def probe(grpc_url: str, voices_npz: Path, tokens: int = 400) -> list[dict]:
    from gateway.pipeline import get_schedule
    from gateway.token2wav import Token2WavClient
    from gateway.voices import load_voice

    voice = load_voice(voices_npz)
    schedule = get_schedule("exponential100")
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, 6561, tokens)]
    rows = []
    async with Token2WavClient(grpc_url) as client:
        for attempt in range(3):  # the first stream also pays for CUDA kernels / graph capture
            async with client.stream(voice, seed=attempt) as stream:
                at, call = 0, 0
                while at < len(ids):
                    n = schedule.tokens_needed(call)
                    piece = ids[at:at + n]
                    at += len(piece)
                    start = time.perf_counter()
                    pcm = await stream.send(piece, final=at >= len(ids))
                    rows.append({"stream": attempt, "call": call, "tokens": len(piece), "samples": int(pcm.size),
                                 "ms": round((time.perf_counter() - start) * 1e3, 2)})
                    call += 1
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.gpu.triton_gpu")
    parser.add_argument("--work", type=Path, default=Path("/tmp/t2w"))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--hold-s", type=float, default=0.0, help="keep serving this long (for a bench)")
    args = parser.parse_args(argv)

    from backends.token2wav.tiny import write_token2wav_dir
    from backends.voices.presets import write_builtin_voices

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "token2wav"
    if not (model_dir / "flow.pt").exists():
        write_token2wav_dir(model_dir, "full", seed=0)
    voice_files = write_builtin_voices(args.work / "voices", num_tokens=150)  # 6 s voice prompts
    started = time.perf_counter()
    server = start_gpu_triton(args.work, model_dir, args.dtype)
    print(json.dumps({"triton_ready_s": round(time.perf_counter() - started, 1), "grpc": server.grpc_url}), flush=True)
    try:
        if args.probe:
            rows = asyncio.run(probe(server.grpc_url, voice_files[0]))
            for row in rows:
                print(json.dumps(row))
        if args.hold_s:
            time.sleep(args.hold_s)
    finally:
        print(server.log_tail(), flush=True)
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
