"""Latency benchmark of the streaming engine with random weights (real "full" dims by default).

    python -m backends.token2wav.bench --device cuda --dtype float16 [--size full] [--prompt-tokens 150]

Streams the upstream schedule (15+3, then 25, 50, 100, 100, ...) and reports per chunk the flow time
and the HiFT time separately (CUDA-synchronised wall time), plus memory per stream and the relative
mel difference between this dtype and float32 on the first chunk. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch

from backends.token2wav.engine import Token2WavEngine
from backends.token2wav.tiny import write_token2wav_dir


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_stream(engine: Token2WavEngine, voice, tokens: list[int], sizes: list[int]) -> list[dict]:
    """Run one stream; time flow and vocoder per feed() call."""
    timings: list[dict] = []
    flow_chunks, vocode_many = engine._flow_chunks, engine._vocode_many
    current: dict = {}

    def timed_flow(states, pending, last_chunk):
        _sync(engine.device)
        start = time.perf_counter()
        mels = flow_chunks(states, pending, last_chunk)
        _sync(engine.device)
        # a call may synthesise several chunks (plan_chunks): sum them
        current["flow_ms"] = current.get("flow_ms", 0.0) + (time.perf_counter() - start) * 1e3
        current["frames"] = current.get("frames", 0) + int(mels[0].shape[2])
        return mels

    def timed_vocode(states, mels, final):
        _sync(engine.device)
        start = time.perf_counter()
        pcms = vocode_many(states, mels, final)
        _sync(engine.device)
        current["hift_ms"] = current.get("hift_ms", 0.0) + (time.perf_counter() - start) * 1e3
        return pcms

    engine._flow_chunks, engine._vocode_many = timed_flow, timed_vocode
    try:
        state = engine.start_stream(voice, seed=1)
        at = 0
        for i, size in enumerate(sizes):
            current.clear()
            pcm = engine.feed(state, tokens[at:at + size], final=i == len(sizes) - 1)
            at += size
            timings.append({**current, "tokens_in": size, "samples_out": int(pcm.size),
                            "state_mib": round(engine.state_nbytes(state) / 2**20, 1)})
    finally:
        engine._flow_chunks, engine._vocode_many = flow_chunks, vocode_many
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.token2wav.bench")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--size", default="full", choices=["tiny", "full"])
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--tokens", type=int, default=1500, help="utterance length (25 per second)")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    prompt = (rng.integers(0, 6561, args.prompt_tokens),
              (rng.standard_normal((2 * args.prompt_tokens, 80)) - 5).astype(np.float32),
              rng.standard_normal(192).astype(np.float32))
    tokens = [int(t) for t in rng.integers(0, 6561, args.tokens)]
    sizes = [18, 25, 50]
    while sum(sizes) + 100 < len(tokens):
        sizes.append(100)
    sizes.append(len(tokens) - sum(sizes))

    report: dict = {"device": args.device, "dtype": args.dtype, "size": args.size,
                    "prompt_tokens": args.prompt_tokens, "utterance_tokens": len(tokens)}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_token2wav_dir(tmp, args.size, seed=0)
        report["write_s"] = round(time.perf_counter() - start, 1)
        engine = Token2WavEngine.load(tmp, device=args.device, dtype=args.dtype)
        reference = Token2WavEngine.load(tmp, device=args.device, dtype="float32") if args.dtype != "float32" else None
    report["flow_params_m"] = round(sum(p.numel() for p in engine.flow.parameters()) / 1e6, 1)
    report["hift_params_m"] = round(sum(p.numel() for p in engine.hift.parameters()) / 1e6, 1)

    _sync(engine.device)
    start = time.perf_counter()
    voice = engine.prepare_voice(*prompt)
    _sync(engine.device)
    report["prepare_voice_ms"] = round((time.perf_counter() - start) * 1e3, 1)
    report["voice_mib"] = round(voice.nbytes() / 2**20, 1)

    _timed_stream(engine, voice, tokens[:200], [18, 25, 50, 107])   # warm-up (allocator, kernels)
    runs = _timed_stream(engine, voice, tokens, sizes)
    report["chunks"] = [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in runs]
    steady = [r for r in runs[3:-1] if r.get("frames") == 200]
    if steady:
        report["steady_100_token_chunk_flow_ms"] = round(float(np.median([r["flow_ms"] for r in steady])), 2)
        report["steady_100_token_chunk_hift_ms"] = round(float(np.median([r["hift_ms"] for r in steady])), 2)
    report["first_chunk_flow_ms"] = round(runs[0]["flow_ms"], 2)
    report["first_chunk_hift_ms"] = round(runs[0]["hift_ms"], 2)
    total_ms = sum(r.get("flow_ms", 0) + r.get("hift_ms", 0) for r in runs)
    report["real_time_factor"] = round(total_ms / 1e3 / (len(tokens) / 25), 4)

    if reference is not None:
        ref_voice = reference.prepare_voice(*prompt)
        mels = []
        for eng, v in ((engine, voice), (reference, ref_voice)):
            state = eng.start_stream(v, seed=3)
            mels.append(eng._flow_chunk(state, tokens[:18], last_chunk=False).float())
        report["first_chunk_mel_rel_rms_vs_fp32"] = round(
            float((mels[0] - mels[1]).pow(2).mean().sqrt() / mels[1].std()), 5)
    if engine.device.type == "cuda":
        report["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
