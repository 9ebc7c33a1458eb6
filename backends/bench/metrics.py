"""Per-request records and per-level summaries shared by every driver.

A request is timed from the moment the driver starts it (the HTTP POST, ``SpeechPipeline.prepare``,
or the simulated LLM request of the token2wav driver) to its last audio. Audio arrives in chunks;
``arrivals`` keeps, per chunk, (seconds after the start, seconds of audio in it).

Playback model (``playback``): a listener starts playing when the first audio arrives and plays
continuously. A chunk that arrives after everything received before it has finished playing is an
**underrun**: playback stalled for (arrival - end of the buffered audio) seconds and resumes with that
chunk, so the playback clock shifts by the stall. How close a request came to one is the **least
buffered** audio: of every chunk after the first, the audio still unplayed when it arrived (negative:
the stall).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

#: What one second of audio is: 24 kHz mono. PCM s16le over HTTP is 48 000 bytes per second.
SAMPLE_RATE = 24_000
PCM16_BYTES_PER_SECOND = 2 * SAMPLE_RATE
#: Audio seconds per speech token (25 tokens per second).
SECONDS_PER_TOKEN = 0.04


@dataclass
class Playback:
    underruns: int
    stall_s: float
    least_buffered_s: float | None = None
    """Least unplayed audio when a chunk after the first arrived (negative: a stall); None: one chunk."""


def playback(arrivals: Sequence[tuple[float, float]]) -> Playback:
    """Underruns of real-time playback that starts with the first chunk (see the module doc).

    ``arrivals``: (arrival time, audio seconds) per chunk, in arrival order; empty chunks are ignored.
    """
    underruns, stall, least = 0, 0.0, None
    played_until: float | None = None  # when the audio received so far will have finished playing
    for at, seconds in arrivals:
        if seconds <= 0:
            continue
        if played_until is None:
            played_until = at + seconds
            continue
        least = played_until - at if least is None else min(least, played_until - at)
        if at > played_until:
            underruns += 1
            stall += at - played_until
            played_until = at + seconds
        else:
            played_until += seconds
    return Playback(underruns, stall, least)


@dataclass
class RequestRecord:
    """One request's measurements. Times are seconds; ``None`` where a driver cannot know it."""

    concurrency: int
    index: int
    """Order in which the level's requests were started (0-based)."""
    worker: int
    text_index: int | None
    started_s: float
    """Start, seconds after the level began."""
    ttfa_s: float | None = None
    """Start to the first audio (first non-empty body chunk / PCM chunk)."""
    first_chunk_s: float | None = None
    """token2wav's first call: sending the first token chunk to getting its PCM (token2wav/pipeline)."""
    llm_first_token_s: float | None = None
    total_s: float | None = None
    audio_s: float = 0.0
    tokens: int | None = None
    """Speech tokens synthesized, where the driver knows them."""
    underruns: int = 0
    stall_s: float = 0.0
    least_buffered_s: float | None = None
    """See ``Playback.least_buffered_s``."""
    error: str | None = None
    """Error type (e.g. ``RateLimitError``, ``APITimeoutError``, ``Token2WavUnavailable``); None: success."""
    error_message: str | None = None
    arrivals: list[tuple[float, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def rtf(self) -> float | None:
        if self.total_s is None or self.audio_s <= 0:
            return None
        return self.total_s / self.audio_s

    def finish(self, total_s: float) -> None:
        """Close the record: total time, audio seconds and playback from the arrivals."""
        self.total_s = total_s
        self.audio_s = sum(seconds for _, seconds in self.arrivals)
        first = next((at for at, seconds in self.arrivals if seconds > 0), None)
        self.ttfa_s = first
        pb = playback(self.arrivals)
        self.underruns, self.stall_s, self.least_buffered_s = pb.underruns, pb.stall_s, pb.least_buffered_s

    def as_dict(self) -> dict:
        out = asdict(self)
        out["rtf"] = self.rtf
        out["arrivals"] = [[round(at, 5), round(seconds, 5)] for at, seconds in self.arrivals]
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 6)
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def summarize(concurrency: int, records: Sequence[RequestRecord], wall_s: float) -> dict:
    """One level's numbers. Latency statistics are over successful requests; milliseconds."""
    ok = [r for r in records if r.ok]
    ttfa = [r.ttfa_s for r in ok if r.ttfa_s is not None]
    total = [r.total_s for r in ok if r.total_s is not None]
    first_chunk = [r.first_chunk_s for r in ok if r.first_chunk_s is not None]
    llm_first = [r.llm_first_token_s for r in ok if r.llm_first_token_s is not None]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    audio = sum(r.audio_s for r in ok)
    summary = {
        "concurrency": concurrency,
        "n": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "errors_by_type": dict(Counter(r.error for r in records if not r.ok)),
        "wall_s": round(wall_s, 4),
        "audio_s": round(audio, 4),
        "throughput_audio_s_per_s": round(audio / wall_s, 4) if wall_s > 0 else None,
        "rtf_mean": round(float(np.mean(rtf)), 5) if rtf else None,
        "rtf_max": round(float(np.max(rtf)), 5) if rtf else None,
        "underruns": sum(r.underruns for r in ok),
        "underrun_requests_pct": round(100.0 * sum(1 for r in ok if r.underruns) / len(ok), 2) if ok else None,
        "stall_s": round(sum(r.stall_s for r in ok), 4),
    }
    for name, values in (("ttfa", ttfa), ("total", total), ("first_chunk", first_chunk),
                         ("llm_first_token", llm_first)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
    summary["ttfa_mean_ms"] = _ms(float(np.mean(ttfa))) if ttfa else None
    # How near the level came to an underrun: the least audio any listener had left when a chunk came.
    buffered = [r.least_buffered_s for r in ok if r.least_buffered_s is not None]
    summary["least_buffered_min_ms"] = _ms(min(buffered)) if buffered else None
    summary["least_buffered_p5_ms"] = _ms(percentile(buffered, 5))
    return summary
