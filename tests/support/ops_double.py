"""A controllable synthesizer double for the reliability/operations tests (no backends).

Behaviour is picked by a marker in the input text:
- ``[hold]``: one chunk, then waits until the test calls ``release_all()`` (a stream held open);
- ``[stall]``: never produces audio; ``[stall-after]``: one chunk, then nothing;
- ``[stall-prepare]``: ``prepare`` itself never returns (an LLM that never gives its first token);
  ``prepare_cancelled`` is set when the gateway gives up on it;
- ``[slow]``: ``SLOW_CHUNKS`` chunks, ``SLOW_GAP_S`` apart (a stream that is in flight for a while);
- anything else: ``CHUNKS`` chunks at once.

``app`` is a module-level app for ``uvicorn tests.support.ops_double:app`` (graceful-shutdown test).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from gateway.app import create_app
from gateway.settings import Settings
from gateway.synth import SAMPLE_RATE, SpeechJob, Usage

CHUNK = 4_800  # 0.2 s
CHUNKS = 3
SLOW_CHUNKS = 10
SLOW_GAP_S = 0.3


def tone(n: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / SAMPLE_RATE)).astype(np.float32)


@dataclass
class OpsSpeech:
    job: SpeechJob
    usage: Usage
    behaviour: str
    release: threading.Event
    closed: threading.Event = field(default_factory=threading.Event)

    async def pcm(self) -> AsyncIterator[np.ndarray]:
        try:
            if self.behaviour == "stall":
                await asyncio.sleep(3600)
            if self.behaviour == "slow":
                for _ in range(SLOW_CHUNKS):
                    yield tone(CHUNK)
                    await asyncio.sleep(SLOW_GAP_S)
                return
            yield tone(CHUNK)
            if self.behaviour == "stall-after":
                await asyncio.sleep(3600)
            if self.behaviour == "hold":
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            for _ in range(CHUNKS - 1):
                yield tone(CHUNK)
        finally:
            self.closed.set()


class OpsSynthesizer:
    MARKERS = ("hold", "stall-after", "stall", "slow")

    def __init__(self, ready: dict[str, bool] | None = None) -> None:
        self.prepared: list[OpsSpeech] = []
        self.release = threading.Event()
        self.backends = ready if ready is not None else {"llm": True, "token2wav": True}
        self.prepare_cancelled = threading.Event()

    async def prepare(self, job: SpeechJob) -> OpsSpeech:
        if "[stall-prepare]" in job.input:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.prepare_cancelled.set()
                raise
        behaviour = next((m for m in self.MARKERS if f"[{m}]" in job.input), "normal")
        speech = OpsSpeech(job, Usage(input_tokens=1), behaviour, self.release)
        self.prepared.append(speech)
        return speech

    async def ready(self) -> dict[str, bool]:
        return dict(self.backends)

    def release_all(self) -> None:
        self.release.set()


def __getattr__(name: str) -> object:
    """``app`` for a uvicorn subprocess (settings from the environment)."""
    if name == "app":
        return create_app(Settings(), OpsSynthesizer())
    raise AttributeError(name)
