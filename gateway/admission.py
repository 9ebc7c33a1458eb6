"""Admission control and per-stream guards for ``POST /v1/audio/speech``.

Why no queue: a speech request holds an LLM generation and a token2wav sequence for its whole
stream, so waiting in line only moves the overload into client timeouts. A request beyond the limit
(gateway-wide or per API key) is answered at once with 429 and ``Retry-After`` (the OpenAI SDK
retries it by itself); nothing ever waits for a slot.

A ``Permit`` is taken before ``prepare`` and released exactly once, whichever comes first: the
stream ends (``GuardedSpeech.pcm``'s ``finally``), the response object finishes, or ``prepare``
fails. ``GuardedSpeech`` also enforces the request and idle timeouts and feeds the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import numpy as np

from gateway.errors import APIError, RateLimitedError, ServiceUnavailableError
from gateway.metrics import GatewayMetrics
from gateway.synth import SAMPLE_RATE, PreparedSpeech, Usage

log = logging.getLogger("gateway.admission")


class RequestTimeoutError(APIError):
    """The synthesis took longer than a configured timeout (the SDK retries 5xx by itself)."""

    def __init__(self, message: str) -> None:
        super().__init__(504, message, type="server_error", code="timeout")


class ClientClosedRequest(APIError):
    """The client left before any audio (nginx's 499; nobody reads it, it only ends the request)."""

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request.", code="cancelled")


class Permit:
    """One admitted stream's slot; ``release()`` is idempotent."""

    def __init__(self, controller: AdmissionController, key: str | None) -> None:
        self._controller = controller
        self.key = key
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._controller._release(self)


class AdmissionController:
    """Counts streams in flight and refuses (never queues) those beyond the limits.

    Runs on one event loop: the check and the increment happen without an ``await`` in between, so
    no lock is needed.
    """

    def __init__(
        self,
        *,
        max_total: int,
        max_per_key: int,
        retry_after_s: float,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.max_total = max_total
        self.max_per_key = max_per_key
        self.retry_after_s = retry_after_s
        self.metrics = metrics
        self.active = 0
        self.per_key: Counter[str] = Counter()
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    def acquire(self, key: str | None) -> Permit:
        """A slot for one stream of ``key`` (None: no per-key limit), or a 429/503 ``APIError``."""
        if self.draining:
            raise ServiceUnavailableError("The server is shutting down; retry on another instance.",
                                          retry_after=self.retry_after_s, code="shutting_down")
        if self.max_total and self.active >= self.max_total:
            self._refused()
            raise RateLimitedError(
                f"Too many concurrent speech streams on this server (limit {self.max_total}); retry shortly.",
                retry_after=self.retry_after_s,
            )
        if key is not None and self.max_per_key and self.per_key[key] >= self.max_per_key:
            self._refused()
            raise RateLimitedError(
                f"Too many concurrent speech streams for this API key (limit {self.max_per_key}); retry shortly.",
                retry_after=self.retry_after_s,
            )
        self.active += 1
        if key is not None:
            self.per_key[key] += 1
        self._idle.clear()
        if self.metrics:
            self.metrics.active_streams.set(self.active)
        return Permit(self, key)

    def _refused(self) -> None:
        if self.metrics:
            self.metrics.error("rate_limited")

    def _release(self, permit: Permit) -> None:
        self.active -= 1
        if permit.key is not None:
            self.per_key[permit.key] -= 1
            if self.per_key[permit.key] <= 0:
                del self.per_key[permit.key]
        if self.metrics:
            self.metrics.active_streams.set(self.active)
        if self.active == 0:
            self._idle.set()

    def reopen(self) -> None:
        """Accept streams again (app startup; an app object may be started again after a shutdown)."""
        self.draining = False

    async def drain(self, deadline_s: float) -> bool:
        """Refuse new streams and wait up to ``deadline_s`` for those in flight; True when all ended."""
        self.draining = True
        if self.active == 0:
            return True
        log.info("draining %d in-flight speech stream(s), up to %.1f s", self.active, deadline_s)
        try:
            await asyncio.wait_for(self._idle.wait(), deadline_s)
        except asyncio.TimeoutError:
            log.warning("shutdown drain deadline passed with %d stream(s) still in flight", self.active)
            return False
        return True


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class GuardedSpeech:
    """Wraps a ``PreparedSpeech``: request/idle timeouts, metrics, and the permit's release."""

    def __init__(
        self,
        inner: PreparedSpeech,
        permit: Permit,
        *,
        request_id: str,
        arrived: float,
        request_timeout_s: float,
        idle_timeout_s: float,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.inner = inner
        self.permit = permit
        self.request_id = request_id
        self.arrived = arrived
        self.deadline = arrived + request_timeout_s if request_timeout_s > 0 else None
        self.idle_timeout_s = idle_timeout_s if idle_timeout_s > 0 else None
        self.metrics = metrics

    @property
    def usage(self) -> Usage:
        return self.inner.usage

    def _next_timeout(self) -> tuple[float | None, str]:
        remaining = _remaining(self.deadline)
        if remaining is not None and (self.idle_timeout_s is None or remaining < self.idle_timeout_s):
            return max(remaining, 0.0), "request"
        return self.idle_timeout_s, "idle"

    async def pcm(self) -> AsyncIterator[np.ndarray]:
        source = aiter(self.inner.pcm())
        samples = 0
        first_at: float | None = None
        outcome = "cancelled"
        try:
            while True:
                timeout, which = self._next_timeout()
                try:
                    chunk = await asyncio.wait_for(anext(source), timeout)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    outcome = "timeout"
                    if self.metrics:
                        self.metrics.error(f"{which}_timeout")
                    log.warning("request %s: %s timeout", self.request_id, which)
                    raise RequestTimeoutError(
                        "The request took too long to synthesize." if which == "request"
                        else "The speech backends stopped producing audio; the request timed out."
                    ) from None
                if first_at is None:
                    first_at = time.monotonic()
                    if self.metrics:
                        self.metrics.time_to_first_audio.observe(first_at - self.arrived)
                samples += chunk.size
                yield chunk
            outcome = "ok"
        except APIError as error:
            outcome = "error"
            if self.metrics and error.code != "timeout":
                self.metrics.error(error.code)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            # The client left (or the server is shutting down): the response closed or cancelled us.
            outcome = "cancelled"
            if self.metrics:
                self.metrics.error("cancelled")
            raise
        except Exception:
            outcome = "error"
            if self.metrics:
                self.metrics.error("internal_error")
            raise
        finally:
            try:
                await _aclose(source)
            finally:
                self.permit.release()
                self._record(outcome, samples)

    def _record(self, outcome: str, samples: int) -> None:
        elapsed = time.monotonic() - self.arrived
        audio_s = samples / SAMPLE_RATE
        if self.metrics:
            self.metrics.request_duration.labels(outcome=outcome).observe(elapsed)
            self.metrics.audio_seconds.inc(audio_s)
            if outcome == "ok" and audio_s > 0:
                self.metrics.real_time_factor.observe(elapsed / audio_s)
        log.info(
            "request %s: stream %s after %.3f s, %.2f s of audio", self.request_id, outcome, elapsed, audio_s,
            extra={"request_id": self.request_id},
        )


async def _aclose(source: AsyncIterator[np.ndarray]) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        await aclose()
