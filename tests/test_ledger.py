"""``Ledger``: what a replica owes the shared rate buckets, on a fake clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.health.ledger import WINDOW_S, Ledger, Owed


def test_what_was_taken_is_owed_less_as_the_bucket_refills_and_not_after_a_minute() -> None:
    ledger = Ledger()
    ledger.add("provider:p", 60, 6000, 10, 1000, now=100.2)
    assert ledger.owed(100.5) == [Owed("provider:p", 60, 6000, 10, 1000)]
    assert ledger.owed(130.5) == [Owed("provider:p", 60, 6000, 5, 500)]
    assert ledger.owed(100.5 + WINDOW_S) == []


def test_what_was_given_back_is_not_owed() -> None:
    ledger = Ledger()
    ledger.add("key:k", 10, 0, 3, 900, now=5.0)
    ledger.add("key:k", 10, 0, -1, -600, now=5.4)
    assert ledger.owed(5.5) == [Owed("key:k", 10, 0, 2, 300)]
    ledger.add("key:k", 10, 0, -2, -300, now=5.9)
    assert ledger.owed(6.0) == []


@given(st.lists(st.tuples(st.floats(0, 200), st.integers(0, 50)), max_size=300),
       st.floats(0, 400))
def test_never_more_than_a_minute_of_bins_and_never_more_owed_than_taken(
        takes: list[tuple[float, int]], after: float) -> None:
    ledger, clock = Ledger(), 0.0
    for step, requests in takes:
        clock += step / 10
        ledger.add("n", 1000, 0, requests, 0, clock)
    assert len(ledger._bins.get("n", ())) <= WINDOW_S + 1
    owed = ledger.owed(clock + after)
    assert sum(o.requests for o in owed) <= sum(r for _, r in takes)
