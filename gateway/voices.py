"""Voices: what token2wav and the LLM need to speak in someone's voice (a CosyVoice "spk2info" entry).

A voice is immutable once computed. Its ``content_hash`` names the conditioning tensors, so any
gateway can send a voice to any token2wav instance and the instance can cache it by that hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

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
