"""Voices: what token2wav and the LLM need to speak in someone's voice (a CosyVoice "spk2info" entry).

A voice is immutable once computed. Its ``content_hash`` names the conditioning tensors, so any
gateway can send a voice to any token2wav instance and the instance can cache it by that hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

#: How the 3-token lookahead after the prompt was padded when the voice's streaming cache was built.
#: "silence": speech token 4218 three times (the Step-Audio2 package); "repeat": the first 3 prompt tokens.
LOOKAHEAD_PADS = ("silence", "repeat")


@dataclass(frozen=True)
class Voice:
    id: str
    name: str
    prompt_text: str
    """Transcript of the prompt audio; empty means the voice is used cross-lingually."""
    prompt_tokens: np.ndarray
    """int32 [T], S3 speech tokens 0..6560 at 25 Hz."""
    prompt_mel: np.ndarray
    """float32 [2T, 80], 24 kHz log-mel of the prompt audio."""
    speaker_embedding: np.ndarray
    """float32 [192], CAM++ embedding."""
    lookahead_pad: str = "silence"
    model_hash: str = ""
    """Hash of the model files the entry was computed with."""
    created_at: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @cached_property
    def content_hash(self) -> str:
        """sha256 over everything token2wav conditions on; the key of its voice cache."""
        return conditioning_hash(self.prompt_tokens, self.prompt_mel, self.speaker_embedding, self.lookahead_pad)


def conditioning_hash(prompt_tokens: np.ndarray, prompt_mel: np.ndarray, speaker_embedding: np.ndarray, lookahead_pad: str) -> str:
    """The content hash token2wav verifies on a cache miss. Both sides must compute it identically."""
    h = hashlib.sha256()
    for arr, dtype in ((prompt_tokens, np.int32), (prompt_mel, np.float32), (speaker_embedding, np.float32)):
        a = np.ascontiguousarray(arr, dtype=dtype)
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    h.update(lookahead_pad.encode())
    return h.hexdigest()


#: The OpenAI built-in voice names; each maps to a configured spk2info entry.
BUILTIN_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse", "marin", "cedar",
)


def save_voice(voice: Voice, path: str | Path) -> None:
    """Write a voice as ``.npz``: arrays plus one JSON metadata string (read back without pickle)."""
    meta = {
        "id": voice.id,
        "name": voice.name,
        "prompt_text": voice.prompt_text,
        "lookahead_pad": voice.lookahead_pad,
        "model_hash": voice.model_hash,
        "created_at": voice.created_at,
        "extra": voice.extra,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        prompt_tokens=np.asarray(voice.prompt_tokens, np.int32),
        prompt_mel=np.asarray(voice.prompt_mel, np.float32),
        speaker_embedding=np.asarray(voice.speaker_embedding, np.float32),
        meta=np.array(json.dumps(meta)),
    )
    os.replace(tmp, path)


def load_voice(path: str | Path) -> Voice:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        voice = Voice(
            id=meta["id"],
            name=meta.get("name", meta["id"]),
            prompt_text=meta.get("prompt_text", ""),
            prompt_tokens=data["prompt_tokens"].astype(np.int32),
            prompt_mel=data["prompt_mel"].astype(np.float32),
            speaker_embedding=data["speaker_embedding"].astype(np.float32),
            lookahead_pad=meta.get("lookahead_pad", "silence"),
            model_hash=meta.get("model_hash", ""),
            created_at=int(meta.get("created_at", 0)),
            extra=meta.get("extra", {}),
        )
    validate_voice(voice)
    return voice


def validate_voice(voice: Voice) -> None:
    tokens, mel, emb = voice.prompt_tokens, voice.prompt_mel, voice.speaker_embedding
    if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() > 6560)):
        raise ValueError(f"voice {voice.id}: prompt_tokens must be 1-D speech token ids 0..6560")
    if mel.ndim != 2 or mel.shape[1] != 80 or mel.shape[0] != 2 * tokens.size:
        raise ValueError(f"voice {voice.id}: prompt_mel must be [2T, 80] for T={tokens.size}, got {mel.shape}")
    if emb.shape != (192,):
        raise ValueError(f"voice {voice.id}: speaker_embedding must be [192], got {emb.shape}")
    if voice.lookahead_pad not in LOOKAHEAD_PADS:
        raise ValueError(f"voice {voice.id}: lookahead_pad must be one of {LOOKAHEAD_PADS}")


class VoiceRegistry:
    """Resolves a request's ``voice`` to a ``Voice``.

    Built-in names map to ``<voices_dir>/builtin/<name>.npz``; a name without its own file uses
    ``builtin/default.npz``. Entries are loaded once at start-up: they are small and immutable.
    """

    def __init__(self, voices_dir: str | Path, store: object | None = None) -> None:
        self.voices_dir = Path(voices_dir)
        self._builtin: dict[str, Voice] = {}
        self.store = store
        """Custom voices: a ``gateway.voice_store.VoiceStore`` (set by the voices routes), or None."""

    def load(self) -> None:
        folder = self.voices_dir / "builtin"
        found = {p.stem: load_voice(p) for p in sorted(folder.glob("*.npz"))} if folder.is_dir() else {}
        default = found.get("default")
        missing = [name for name in BUILTIN_VOICES if name not in found and default is None]
        if missing:
            raise RuntimeError(f"no voice entry for built-in voices {missing} in {folder} (and no default.npz)")
        self._builtin = {name: found.get(name, default) for name in BUILTIN_VOICES}  # type: ignore[misc]

    async def resolve(self, voice: str | dict) -> Voice:
        from gateway.errors import APIError  # local: errors imports nothing from here, keep it that way

        if isinstance(voice, str):
            try:
                return self._builtin[voice]
            except KeyError:
                raise APIError(400, f"Unknown voice {voice!r}.", param="voice", code="invalid_value") from None
        from gateway.voice_store import is_voice_id  # local: voice_store imports this module

        voice_id = voice.get("id")
        if self.store is not None and is_voice_id(voice_id):
            found = await self.store.get_voice(voice_id)  # type: ignore[attr-defined]
            if found is not None:
                return found
        raise APIError(404, f"Voice {voice_id!r} not found.", param="voice", code="voice_not_found")
