"""The engine call look-ahead: learned call costs, and how many rows a call takes so others stay in time."""

from __future__ import annotations

import pytest

from backends.token2wav.scheduling import CallCosts, Due, graph_rows, missed_deadlines, rows_keeping_deadlines

FULL, MID, SHORT = (100, False), (75, False), (25, False)


def _h100_like() -> CallCosts:
    """Call seconds as an H100 trace measured them (16 streams' 100-token chunks: ~144 ms)."""
    costs = CallCosts()
    for key, by_rows in {FULL: {1: 0.022, 2: 0.033, 4: 0.047, 8: 0.080, 16: 0.144},
                         MID: {1: 0.023, 2: 0.031, 4: 0.045, 8: 0.061},
                         SHORT: {1: 0.021, 2: 0.026, 4: 0.031, 8: 0.040, 16: 0.058}}.items():
        for rows, seconds in by_rows.items():
            costs.observe(key, rows, seconds)
    return costs


def test_graph_rows_pad_to_a_power_of_two():
    assert [graph_rows(r) for r in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]


def test_call_costs_average_and_scale_from_what_was_seen():
    costs = CallCosts()
    assert costs.estimate(FULL, 4) == 0.0                 # nothing seen: no opinion
    costs.observe(FULL, 4, 0.040)
    assert costs.estimate(FULL, 3) == pytest.approx(0.040)   # 3 rows run as the 4-row graph
    costs.observe(FULL, 4, 0.080)
    assert 0.040 < costs.estimate(FULL, 4) < 0.080         # a running average moves towards the new
    assert costs.estimate(FULL, 1) == costs.estimate(FULL, 4)    # a smaller batch is no slower: flat below
    assert costs.estimate(FULL, 16) == pytest.approx(4 * costs.estimate(FULL, 4))  # per row above
    assert costs.estimate(SHORT, 16) == 0.0 and len(costs) == 1


def test_missed_deadlines_plays_the_calls_forward():
    costs = _h100_like()
    # A 16-row 100-token call (144 ms), then the 25-token feeds' call (31 ms): due at 150 ms, they miss.
    queue = [Due(0.226, FULL)] + [Due(5.0, FULL)] * 15 + [Due(0.150, SHORT)] * 3
    assert missed_deadlines(0.0, queue, FULL, 16, 16, costs) == 3
    assert missed_deadlines(0.0, queue, FULL, 4, 16, costs) == 0     # 47 + 31 ms
    # Calls whose most urgent feed is due past the horizon are not played.
    queue = [Due(0.05, FULL), Due(0.04, SHORT)]
    assert missed_deadlines(0.0, queue, FULL, 1, 16, costs) == 1             # 22 + 21 ms > 40 ms
    assert missed_deadlines(0.0, queue, FULL, 1, 16, costs, horizon=0.03) == 0
    # With a margin, a chunk that leaves its listener less than that much audio counts as late too.
    queue = [Due(0.05, FULL), Due(0.06, SHORT)]                          # done at 22 and 43 ms
    assert missed_deadlines(0.0, queue, FULL, 1, 16, costs) == 0
    assert missed_deadlines(0.0, queue, FULL, 1, 16, costs, margin=0.02) == 1


def test_a_feed_of_several_chunks_is_late_by_its_last_one():
    """A catch-up feed (100 tokens, then 75) joins the 75-token call after its first chunk, and its
    listener hears nothing until that one is done."""
    costs = _h100_like()
    queue = sorted([Due(0.20, FULL, then=(MID,))] * 4 + [Due(6.0, FULL)] * 12
                   + [Due(0.21, MID)] * 4 + [Due(0.26, SHORT)] * 3)
    single = [due._replace(then=()) for due in queue]
    # 16 x 100 tokens: 144 ms. Were the catch-ups done then, everyone would be in time ...
    assert missed_deadlines(0.0, single, FULL, 16, 16, costs) == 0
    # ... but they still need the 75-token call (8 rows, 61 ms): done at 205 ms, 5 ms after their deadline.
    assert missed_deadlines(0.0, queue, FULL, 16, 16, costs) == 4
    assert rows_keeping_deadlines(0.0, queue, FULL, 16, 16, costs, margin=0.0) == 8


def test_a_full_call_shrinks_when_it_would_make_another_size_late():
    """The 64-stream trace: the most urgent listener's 100-token call would take 16 streams (144 ms)
    while second chunks (25 tokens) and 75-token chunks, due ~225 ms out, waited; listeners stalled."""
    costs = _h100_like()
    queue = sorted([Due(0.226, FULL)] + [Due(0.9, FULL)] * 3 + [Due(6.0, FULL)] * 12
                   + [Due(0.228, MID)] * 5 + [Due(0.230, SHORT)] * 3)
    rows = rows_keeping_deadlines(0.0, queue, FULL, 16, 16, costs, horizon=1.0)
    assert rows == 8
    assert missed_deadlines(0.0, queue, FULL, rows, 16, costs, horizon=1.0) == 0
    assert missed_deadlines(0.0, queue, FULL, 16, 16, costs, horizon=1.0) > 0


def test_the_call_stays_full_when_nothing_else_is_near_its_deadline():
    costs = _h100_like()
    queue = [Due(0.2, FULL)] * 16 + [Due(3.0, SHORT)] * 8
    assert rows_keeping_deadlines(0.0, queue, FULL, 16, 16, costs, horizon=1.0) == 16
    # and never more than the feeds of its size, or the rows offered
    assert rows_keeping_deadlines(0.0, [Due(0.2, FULL)] * 3, FULL, 16, 16, costs, horizon=1.0) == 3
    assert rows_keeping_deadlines(0.0, [Due(0.2, FULL)] * 6, FULL, 4, 16, costs, horizon=1.0) == 4


def test_when_every_choice_misses_the_one_missing_fewest_wins_and_ties_keep_the_larger():
    costs = _h100_like()
    already_late = [Due(-0.5, SHORT)] * 2
    queue = sorted([Due(-1.0, FULL)] * 16 + already_late)   # everyone is late whatever runs
    assert rows_keeping_deadlines(0.0, queue, FULL, 16, 16, costs, horizon=1.0) == 16
    # A new stream's first chunk that would wait past its 100 ms is no stall: it does not shrink the call.
    first = (15, False)
    queue = [Due(0.2, FULL)] * 16 + [Due(0.1, first, listening=False)] * 4
    assert rows_keeping_deadlines(0.0, queue, FULL, 16, 16, costs, horizon=1.0) == 16
    unknown = CallCosts()                                   # no costs seen: the full call, as before
    assert rows_keeping_deadlines(0.0, [Due(0.1, FULL)] * 16 + [Due(0.1, SHORT)], FULL, 16, 16, unknown,
                                  horizon=1.0) == 16
