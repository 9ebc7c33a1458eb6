"""How many streams the next engine call takes: learned call costs and a look-ahead over deadlines.

``FeedBatch`` runs earliest deadline first, one chunk size per call. A call cannot be interrupted, and
its length grows with its rows: 16 streams' 100-token chunks take ~140 ms on an H100, 4 streams' ~45 ms.
Filled to the brim, a call for the most urgent listener can make others late whose chunks are another
size: measured at 64 streams, a 16-row 100-token call whose own head had 226 ms of audio left ran while
second chunks (25 tokens, 0.44 s of first audio) waited, and those listeners stalled 7 ms. So before a
call, ``rows_keeping_deadlines`` plays the next few calls forward (earliest deadline first, the call
costs learned so far, no new arrivals) for each batch size the graphs have and takes the largest that
misses the fewest deadlines. When nothing else is near its deadline that is the full call, as before.

A chunk counts as late when it would leave its listener less than ``MARGIN_S`` of audio: call times
vary (16 streams' 100-token chunks: 124-153 ms in one H100 run) and the answer still has to travel.
Measured at 64 streams without the margin: calls chosen to end 19-35 ms before a listener ran dry.
"""

from __future__ import annotations

import bisect
import math
from typing import Hashable, Iterable, NamedTuple

class Due(NamedTuple):
    """A feed waiting for the engine, as the look-ahead sees it."""

    deadline: float
    key: Hashable
    """Its next chunk's size (``_Feed.batch_key``): feeds of one key run together."""
    listening: bool = True
    """Whether a listener's audio runs out at ``deadline`` (a stall if missed). A new stream's first
    chunk is False: its deadline orders the calls but missing it only delays first audio, and counting
    it would shrink calls on a GPU too slow to meet it anyway, for no listener's sake."""
    then: tuple = ()
    """The keys of the feed's chunks after the next (a catch-up feed of 175 tokens: 100, then 75); its
    answer, and so its listener's audio, comes after the last of them."""


#: Audio a listener should still have when its chunk is done, for the look-ahead to call it in time.
MARGIN_S = 0.05

#: Weight of the newest duration in a call cost's running average.
COST_EMA_WEIGHT = 0.25


def graph_rows(rows: int) -> int:
    """The batch a call of ``rows`` streams runs as: padded up to a power of two (its CUDA graph)."""
    return 1 << max(rows - 1, 0).bit_length()


def powers_of_two_down(limit: int) -> list[int]:
    """The batch sizes graphs are captured for (batches are padded to a power of two), largest first."""
    return [1 << k for k in range(max(limit, 1).bit_length() - 1, -1, -1)]


class CallCosts:
    """Seconds an engine call takes, by (chunk key, padded rows), learned from the calls that ran.

    A running average, so a slower or faster phase (other work on the GPU, a warmer cache) moves the
    estimate within a few calls. Calls that captured CUDA graphs or ran a part eagerly are not fed in
    (``FeedBatch`` leaves them out): they are one-off costs, often ten times the steady one.
    """

    def __init__(self) -> None:
        self._seconds: dict[tuple[Hashable, int], float] = {}

    def observe(self, key: Hashable, rows: int, seconds: float) -> None:
        slot = (key, graph_rows(rows))
        known = self._seconds.get(slot)
        self._seconds[slot] = seconds if known is None else known + COST_EMA_WEIGHT * (seconds - known)

    def estimate(self, key: Hashable, rows: int) -> float:
        """The expected seconds; unseen sizes scale from the nearest seen batch of that key (per row
        above it, flat below it: a smaller batch is no slower), and an unseen key costs 0 (nothing to
        go on: the look-ahead then changes nothing)."""
        padded = graph_rows(rows)
        exact = self._seconds.get((key, padded))
        if exact is not None:
            return exact
        seen = sorted((r, s) for (k, r), s in self._seconds.items() if k == key)
        if not seen:
            return 0.0
        above = [s for r, s in seen if r >= padded]
        if above:
            return above[0]
        r, s = seen[-1]
        return s * padded / r

    def __len__(self) -> int:
        return len(self._seconds)


def missed_deadlines(now: float, queue: Iterable[Due], first_key: Hashable, first_rows: int,
                     max_rows: int, costs: CallCosts, horizon: float = math.inf, margin: float = 0.0) -> int:
    """How many listeners in ``queue`` get their chunk later than ``margin`` before their deadline if
    the next call takes ``first_rows`` feeds of ``first_key`` and every later call runs earliest
    deadline first with up to ``max_rows`` (as ``FeedBatch`` would, with no new arrivals). Calls whose
    most urgent feed is due at ``horizon`` or later are not played: too far off for this call's size
    to matter."""
    groups: dict[Hashable, list[Due]] = {}
    for due in sorted(queue, key=lambda item: item.deadline):
        groups.setdefault(due.key, []).append(due)
    t, missed = now, 0
    key, take = first_key, first_rows
    while key in groups:
        waiting = groups.pop(key)
        taken, rest = waiting[:take], waiting[take:]
        if rest:
            groups[key] = rest
        t += costs.estimate(key, len(taken))
        for due in taken:
            if due.then:  # its next chunk joins the feeds of that size, in deadline order
                bisect.insort(groups.setdefault(due.then[0], []), due._replace(key=due.then[0], then=due.then[1:]),
                              key=lambda item: item.deadline)
            else:
                missed += due.listening and due.deadline - margin < t
        if not groups:
            break
        key = min(groups, key=lambda k: groups[k][0].deadline)
        if groups[key][0].deadline >= horizon:
            break
        take = max_rows
    return missed


def rows_keeping_deadlines(now: float, queue: list[Due], chosen: Hashable, rows: int, max_rows: int,
                           costs: CallCosts, horizon: float = math.inf, margin: float = MARGIN_S) -> int:
    """The rows (at most ``rows``) the next call of ``chosen``-key feeds should take: of ``rows`` and the
    powers of two below it, the largest that leaves the fewest listeners late, over ``queue`` (every
    feed waiting; ``chosen`` is the key of the earliest). ``horizon``, ``margin``: see ``missed_deadlines``."""
    full = max(1, min(rows, sum(1 for due in queue if due.key == chosen)))
    near = [due for due in queue if due.deadline < horizon]
    if len(near) <= full and all(due.key == chosen for due in near):
        return full  # everything near its deadline goes in this one call
    candidates = [full] + [r for r in powers_of_two_down(full) if r < full]
    best, best_missed = full, None
    for candidate in candidates:  # largest first: a tie keeps the larger call
        missed = missed_deadlines(now, queue, chosen, candidate, max_rows, costs, horizon, margin)
        if best_missed is None or missed < best_missed:
            best, best_missed = candidate, missed
        if missed == 0:
            break
    return best
