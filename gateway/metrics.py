"""Prometheus metrics of the gateway (served on ``GET /metrics``).

Each app gets its own ``CollectorRegistry`` rather than prometheus_client's global one, so several
apps in one process (tests) never collide on metric names. Names carry the ``tts_`` prefix:

- ``tts_time_to_first_audio_seconds``: request arrival to the first PCM chunk (what a caller waits);
- ``tts_request_duration_seconds``: request arrival to the end of the stream, by outcome;
- ``tts_real_time_factor``: stream wall time / audio seconds produced (below 1 = faster than real time);
- ``tts_active_streams``: speech streams holding an admission slot right now;
- ``tts_errors_total{type}``: failures by kind (the error code, ``cancelled`` (client gone), ``rate_limited``...);
- ``tts_llm_first_token_seconds`` and ``tts_token2wav_chunk_seconds``: backend latencies, fed by
  ``gateway.pipeline`` through ``attach_metrics``.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Latency buckets (seconds): sub-second first audio on a GPU up to minutes on a loaded CPU box.
LATENCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


class GatewayMetrics:
    """The gateway's collectors on one private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.time_to_first_audio = Histogram(
            "tts_time_to_first_audio_seconds", "Request arrival to the first audio chunk.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.request_duration = Histogram(
            "tts_request_duration_seconds", "Request arrival to the end of the speech stream.",
            ["outcome"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.real_time_factor = Histogram(
            "tts_real_time_factor", "Stream wall time divided by the audio duration produced.",
            buckets=RTF_BUCKETS, registry=r,
        )
        self.active_streams = Gauge("tts_active_streams", "Speech streams in flight.", registry=r)
        self.errors = Counter("tts_errors_total", "Failed or refused speech requests, by type.", ["type"], registry=r)
        self.audio_seconds = Counter("tts_audio_seconds_total", "Seconds of audio produced.", registry=r)
        self.llm_first_token = Histogram(
            "tts_llm_first_token_seconds", "LLM request to its first speech token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.token2wav_chunk = Histogram(
            "tts_token2wav_chunk_seconds", "One token2wav chunk call (tokens sent to PCM back).",
            buckets=LATENCY_BUCKETS, registry=r,
        )

    def error(self, kind: str | None) -> None:
        self.errors.labels(type=kind or "unknown").inc()

    def observe_llm_first_token(self, seconds: float) -> None:
        self.llm_first_token.observe(seconds)

    def observe_token2wav_chunk(self, seconds: float) -> None:
        self.token2wav_chunk.observe(seconds)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
