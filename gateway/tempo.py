"""Streaming, pitch-preserving speed change for ``speed`` != 1.

FFmpeg's ``atempo`` filter (WSOLA) through PyAV: it works on a stream of frames, so speed changes
keep audio streaming. One ``atempo`` handles factors 0.5–2.0 well; wider factors chain instances.
"""

from __future__ import annotations

import fractions

import numpy as np


def _atempo_factors(speed: float) -> list[float]:
    factors: list[float] = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    factors.append(speed)
    return factors


class TempoStretcher:
    """Push float32 mono PCM in, get the same audio at ``speed`` times the rate, same pitch."""

    def __init__(self, speed: float, sample_rate: int = 24000) -> None:
        self.sample_rate = sample_rate
        import av  # here, not at import time: the pipeline (and GPU benchmarks without PyAV) import this module

        self._graph = av.filter.Graph()
        nodes = [
            self._graph.add_abuffer(
                format="flt", sample_rate=sample_rate, layout="mono", time_base=fractions.Fraction(1, sample_rate)
            )
        ]
        nodes += [self._graph.add("atempo", f"{factor:.6f}") for factor in _atempo_factors(speed)]
        nodes.append(self._graph.add("abuffersink"))
        for upstream, downstream in zip(nodes, nodes[1:]):
            upstream.link_to(downstream)
        self._graph.configure()
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        if pcm.size == 0:
            return pcm.astype(np.float32)
        from av.audio.frame import AudioFrame

        frame = AudioFrame.from_ndarray(np.ascontiguousarray(pcm, dtype=np.float32)[None, :], format="flt", layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        self._pts += pcm.size
        self._graph.push(frame)
        return self._drain()

    def flush(self) -> np.ndarray:
        self._graph.push(None)
        return self._drain()

    def _drain(self) -> np.ndarray:
        import av

        out: list[np.ndarray] = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
