"""Endpoint pools: several LLM servers or Tritons behind one gateway, least-active-streams routing.

Why: one GPU host is not always enough, and the LLM and token2wav scale differently (disaggregated
deployment: LLM pods on one GPU pool, token2wav pods on another). The gateway therefore holds a list
of endpoints per backend and, for every new utterance (segment), takes the endpoint with the fewest
streams this gateway has open on it. Counting our own streams needs no round trip and is what the
servers' capacity is about (token2wav holds per-stream GPU state; the LLM batches running streams).

Health: a background task probes every endpoint every ``health_interval_s``; a request that finds an
endpoint unreachable marks it down at once (``mark_down``), so the next utterance avoids it without
waiting for the probe. Down endpoints are chosen only when no endpoint is up (the probe may be stale;
a request then fails with the backend's own "unavailable" error, a 503, instead of "no endpoint").

Stickiness is the caller's: ``acquire()`` hands out one endpoint for the duration of one utterance;
token2wav keeps an utterance's streaming state on the instance that started it, so an utterance never
moves. Only the start of an utterance may be retried elsewhere (see ``gateway.pipeline``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger("gateway.pools")

C = TypeVar("C")


@dataclass(eq=False)
class Endpoint(Generic[C]):
    """One server: its client, the streams this gateway has open on it, and its last known health."""

    name: str
    client: C
    active: int = 0
    healthy: bool = True
    failures: int = 0
    """Consecutive failed probes or requests (0 once it answers again)."""
    acquired: int = 0
    """Utterances handed to this endpoint so far (tries that failed over included)."""


class EndpointPool(Generic[C]):
    """Endpoints of one backend kind; ``acquire()`` picks the least-loaded healthy one."""

    def __init__(
        self,
        kind: str,
        endpoints: Sequence[tuple[str, C]],
        probe: Callable[[C], Awaitable[bool]],
        *,
        close: Callable[[C], Awaitable[None]] | None = None,
        health_interval_s: float = 2.0,
        probe_timeout_s: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError(f"the {kind} pool needs at least one endpoint")
        self.kind = kind
        self.endpoints = [Endpoint(name, client) for name, client in endpoints]
        self._probe = probe
        self._close = close
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._rotation = itertools.count()
        self._task: asyncio.Task[None] | None = None

    @property
    def clients(self) -> list[C]:
        return [endpoint.client for endpoint in self.endpoints]

    # ----------------------------------------------------------------- routing

    def pick(self, exclude: Collection[Endpoint[C]] = ()) -> Endpoint[C] | None:
        """The healthy endpoint with the fewest active streams (down ones only if none is up);
        ``None`` when every endpoint is excluded. Ties rotate, so light load still spreads."""
        candidates = [e for e in self.endpoints if e not in exclude]
        if not candidates:
            return None
        healthy = [e for e in candidates if e.healthy] or candidates
        fewest = min(e.active for e in healthy)
        tied = [e for e in healthy if e.active == fewest]
        return tied[next(self._rotation) % len(tied)]

    @contextlib.asynccontextmanager
    async def acquire(self, exclude: Collection[Endpoint[C]] = ()) -> AsyncIterator[Endpoint[C]]:
        """Hold one endpoint (counted as one active stream) for one utterance."""
        endpoint = self.pick(exclude)
        if endpoint is None:
            raise LookupError(f"no {self.kind} endpoint left to try")
        endpoint.active += 1
        endpoint.acquired += 1
        try:
            yield endpoint
        finally:
            endpoint.active -= 1

    def mark_down(self, endpoint: Endpoint[C], reason: object) -> None:
        """A request found ``endpoint`` unreachable: avoid it until a probe succeeds."""
        if endpoint.healthy:
            log.warning("%s endpoint %s marked down: %s", self.kind, endpoint.name, reason)
        endpoint.healthy = False
        endpoint.failures += 1

    # ----------------------------------------------------------------- health

    async def _probe_one(self, endpoint: Endpoint[C]) -> None:
        try:
            ok = bool(await asyncio.wait_for(self._probe(endpoint.client), self.probe_timeout_s))
        except Exception:  # noqa: BLE001 - any probe failure means "not usable now"
            ok = False
        if ok and not endpoint.healthy:
            log.info("%s endpoint %s is up again", self.kind, endpoint.name)
        elif not ok and endpoint.healthy:
            log.warning("%s endpoint %s failed its health check", self.kind, endpoint.name)
        endpoint.healthy = ok
        endpoint.failures = 0 if ok else endpoint.failures + 1

    async def check(self) -> bool:
        """Probe every endpoint now; True when at least one is healthy."""
        await asyncio.gather(*(self._probe_one(e) for e in self.endpoints))
        return any(e.healthy for e in self.endpoints)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check()

    async def start(self) -> None:
        """First probe (so a dead endpoint is avoided from the first request), then the probe loop."""
        await self.check()
        if self._task is None and self.health_interval_s > 0:
            self._task = asyncio.create_task(self._health_loop(), name=f"{self.kind}-pool-health")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._close is not None:
            for endpoint in self.endpoints:
                await self._close(endpoint.client)

    def snapshot(self) -> list[dict[str, object]]:
        """Per-endpoint state, for logs and debugging."""
        return [{"endpoint": e.name, "active": e.active, "healthy": e.healthy, "failures": e.failures,
                 "acquired": e.acquired} for e in self.endpoints]
