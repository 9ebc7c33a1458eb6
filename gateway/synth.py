"""The seam between the HTTP layer and speech synthesis.

The app (``gateway.app``) only knows these types: it validates a request into a ``SpeechJob``, asks a
``Synthesizer`` to ``prepare`` it (every check that needs a backend happens there, before the 200 is
sent), then pulls PCM from the returned ``PreparedSpeech`` and encodes it. The real implementation is
``gateway.pipeline.SpeechPipeline``; tests use synthetic doubles.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

#: Sample rate of every PCM chunk a ``PreparedSpeech`` yields.
SAMPLE_RATE = 24_000


@dataclass
class SpeechJob:
    """A validated ``POST /v1/audio/speech`` request: everything the synthesizer needs."""

    request_id: str
    model: str
    """The model id the client asked for (our own name or one of its OpenAI aliases)."""
    input: str
    voice: str | dict
    """A built-in voice name, or ``{"id": "voice_..."}`` for a custom voice (resolved by the synthesizer)."""
    instructions: str | None = None
    speed: float = 1.0
    response_format: str = "mp3"
    stream_format: str = "audio"
    normalize: bool | None = None
    """Text normalization on/off for this request (extension field); None: the server's default."""


@dataclass
class Usage:
    """Token counts reported in the SSE ``speech.audio.done`` event."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "total_tokens": self.total_tokens,
        }


@runtime_checkable
class PreparedSpeech(Protocol):
    """One accepted request, ready to produce audio."""

    usage: Usage
    """Filled while synthesis progresses; final once the ``pcm()`` iterator is exhausted."""

    def pcm(self) -> AsyncIterator[np.ndarray]:
        """float32 mono ``SAMPLE_RATE`` Hz chunks, in order, as soon as each is produced.

        Called once. The app calls ``aclose()`` on the iterator when the client goes away (or on any
        failure), which must cancel the backend work. An exception raised while iterating means the
        synthesis failed after the response began.
        """
        ...


@runtime_checkable
class Synthesizer(Protocol):
    async def prepare(self, job: SpeechJob) -> PreparedSpeech:
        """Check what needs backends (voice exists, instructions fit) and reserve the work.

        Raises ``gateway.errors.APIError`` (400/404 for the client's mistakes, 503 when a backend is
        down); nothing has been sent to the client yet when this runs.
        """
        ...


__all__ = ["SAMPLE_RATE", "PreparedSpeech", "SpeechJob", "Synthesizer", "Usage"]
