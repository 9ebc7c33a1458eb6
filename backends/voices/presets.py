"""Preset voices for the built-in names.

Until a voice encoder computes real entries from audio, the local stack ships random conditioning:
plausible shapes and value ranges, a different speaker per name, deterministic per seed.
``python -m backends.voices.presets OUT_DIR`` writes one entry per built-in name.
"""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path

import numpy as np

from gateway.voices import BUILTIN_VOICES, Voice, save_voice


def random_voice(name: str, seed: int, num_tokens: int = 50, prompt_text: str = "") -> Voice:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6561, size=num_tokens, dtype=np.int32)
    # Log-mel in the range real 24 kHz speech occupies (log of clamp 1e-5 → about -11.5 .. 2),
    # smooth over time like speech rather than white noise.
    base = rng.normal(-5.0, 1.5, size=(1, 80))
    walk = np.cumsum(rng.normal(0.0, 0.3, size=(2 * num_tokens, 80)), axis=0)
    mel = np.clip(base + walk - walk.mean(axis=0), -11.5, 2.0).astype(np.float32)
    embedding = rng.normal(size=192).astype(np.float32)
    embedding /= np.linalg.norm(embedding)
    return Voice(
        id=name,
        name=name,
        prompt_text=prompt_text,
        prompt_tokens=tokens,
        prompt_mel=mel,
        speaker_embedding=embedding,
        lookahead_pad="silence",
        model_hash="random",
    )


def write_builtin_voices(voices_dir: str | Path, num_tokens: int = 50) -> list[Path]:
    """One random entry per built-in name under ``<voices_dir>/builtin/``; existing files are kept."""
    folder = Path(voices_dir) / "builtin"
    written = []
    for name in BUILTIN_VOICES:
        path = folder / f"{name}.npz"
        if not path.exists():
            save_voice(random_voice(name, seed=zlib.crc32(name.encode()), num_tokens=num_tokens), path)
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("voices_dir")
    parser.add_argument("--num-tokens", type=int, default=50)
    args = parser.parse_args()
    for path in write_builtin_voices(args.voices_dir, args.num_tokens):
        print(path)


if __name__ == "__main__":
    main()
