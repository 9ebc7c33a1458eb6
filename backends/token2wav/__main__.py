"""Offline CLI: speech tokens + voice -> 24 kHz wav.

    python -m backends.token2wav --model-dir DIR --tokens 1,2,3 --out out.wav \
        [--voice voice.npz] [--device cpu] [--dtype float32] [--stream] [--seed 0]

--tokens is a comma/space separated list or a path to a file holding one. --voice is an .npz with
``prompt_tokens`` [T], ``prompt_mel`` [2T, 80], ``speaker_embedding`` [192] (optional
``lookahead_pad``); without it a random voice (fixed seed) is used. --stream runs the streaming path
with the upstream chunk schedule (15+3, then 25, 50, 100, ...) instead of one offline pass.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
import wave
from pathlib import Path

import numpy as np


def parse_tokens(spec: str) -> list[int]:
    looks_like_list = re.fullmatch(r"[\d\s,]*", spec) is not None
    text = spec if looks_like_list else Path(spec).read_text(encoding="utf-8")
    parts = [p for p in re.split(r"[\s,]+", text.strip()) if p]
    try:
        return [int(p) for p in parts]
    except ValueError as exc:
        raise SystemExit(f"--tokens: not a list of integers: {exc}") from None


def random_voice(seed: int = 0, n_tokens: int = 50) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "prompt_tokens": rng.integers(0, 6561, n_tokens),
        "prompt_mel": (rng.standard_normal((2 * n_tokens, 80)) - 5.0).astype(np.float32),
        "speaker_embedding": rng.standard_normal(192).astype(np.float32),
    }


def stream_schedule(n_tokens: int, first: int = 15, lookahead: int = 3) -> list[int]:
    """Sizes of the token pieces a streaming client would send: first+lookahead, then 25, 50, 100, ..."""
    pieces, sent, hop = [], 0, 25
    if n_tokens <= first + lookahead:
        return [n_tokens]
    pieces.append(first + lookahead)
    sent = first + lookahead
    while sent + hop < n_tokens:
        pieces.append(hop)
        sent += hop
        hop *= 2
    pieces.append(n_tokens - sent)
    return pieces


def write_wav(path: Path, pcm: np.ndarray, sample_rate: int) -> None:
    data = (np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(data.tobytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backends.token2wav", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, help="folder with flow.yaml, flow.pt, hift.pt")
    parser.add_argument("--tokens", required=True, help="comma/space separated ids 0..6560, or a file of them")
    parser.add_argument("--voice", help=".npz with prompt_tokens, prompt_mel, speaker_embedding")
    parser.add_argument("--out", required=True, help="output .wav (16-bit PCM, 24 kHz mono)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--stream", action="store_true", help="use the streaming path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from backends.token2wav.engine import Token2WavEngine

    tokens = parse_tokens(args.tokens)
    engine = Token2WavEngine.load(args.model_dir, device=args.device, dtype=args.dtype)
    if args.voice:
        with np.load(args.voice) as npz:
            voice_data = {k: npz[k] for k in npz.files}
    else:
        voice_data = random_voice()
    pad = str(voice_data.pop("lookahead_pad", "silence"))
    try:
        voice = engine.prepare_voice(voice_data["prompt_tokens"], voice_data["prompt_mel"],
                                     voice_data["speaker_embedding"], lookahead_pad=pad)
        started = time.perf_counter()
        if args.stream:
            state = engine.start_stream(voice, seed=args.seed)
            pieces, at = [], 0
            sizes = stream_schedule(len(tokens))
            for i, size in enumerate(sizes):
                pieces.append(engine.feed(state, tokens[at:at + size], final=i == len(sizes) - 1))
                at += size
            pcm = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        else:
            pcm = engine.synthesize(voice, tokens, seed=args.seed)
    except (KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    write_wav(Path(args.out), pcm, engine.sample_rate)
    print(f"wrote {args.out}: {len(pcm)} samples ({len(pcm) / engine.sample_rate:.2f} s) in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
