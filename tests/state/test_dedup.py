"""The dedup table (``state.dedup``): a claim commits with the handler's work, or not at all.

A redelivery of a message whose work committed finds its row; a rolled-back
unit leaves none, so the redelivery runs the handler again. A batch claims
its rows in one statement (an array on PostgreSQL); old rows are purged in
short batches.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from mdbcontainer.state.counts import DeliveryCounter
from mdbcontainer.state.dedup import Dedup
from mdbcontainer.state.store import Store


def test_a_claim_is_seen_once_its_transaction_commits_and_a_second_claim_loses(store: Store) -> None:
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        assert dedup.claim(session, "Orders", "m-1")
        assert not dedup.seen("Orders", "m-1"), "not before the commit: the work may still roll back"
    assert dedup.seen("Orders", "m-1")
    with store.sessions() as session, session.begin():
        assert not dedup.claim(session, "Orders", "m-1"), "a redelivery after the commit is a duplicate"
    assert not dedup.seen("Payments", "m-1"), "a row is the port's: another port handles the message too"


def test_a_rolled_back_unit_claims_nothing(store: Store) -> None:
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        assert dedup.claim(session, "Orders", "m-1")
        session.rollback()
    assert not dedup.seen("Orders", "m-1")
    with store.sessions() as session, session.begin():
        assert dedup.claim(session, "Orders", "m-1"), "the redelivery claims it"


def test_a_batch_claims_its_new_ids_in_one_statement_each_id_once(store: Store) -> None:
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        assert dedup.claim(session, "Orders", "m-2")
    with store.sessions() as session, session.begin():
        claimed = dedup.claim_many(session, "Orders", ["m-3", "m-1", "m-2", "m-3"])
    assert claimed == {"m-1", "m-3"}, "m-2 was claimed before: a duplicate"
    assert dedup.seen_many("Orders", ["m-1", "m-2", "m-3", "m-4"]) == {"m-1", "m-2", "m-3"}
    with store.sessions() as session, session.begin():
        assert dedup.claim_many(session, "Orders", []) == set()
    assert dedup.count("Orders") == 3 and dedup.count() == 3


def test_forgetting_a_row_lets_a_replayed_message_be_handled_again_once_per_replay(store: Store) -> None:
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        dedup.claim(session, "Orders", "m-1")
    assert dedup.forget_once("Orders", "m-1", "replay-1")
    assert not dedup.seen("Orders", "m-1")
    with store.sessions() as session, session.begin():
        assert dedup.claim(session, "Orders", "m-1")  # the replayed copy, handled again
    assert not dedup.forget_once("Orders", "m-1", "replay-1"), "the same replay run again forgets nothing"
    assert dedup.seen("Orders", "m-1")


@pytest.mark.parametrize("batch", [2, 1000])
def test_the_purge_removes_the_rows_past_the_retention_in_short_batches(store: Store, batch: int) -> None:
    dedup = Dedup(store)
    with store.sessions() as session, session.begin():
        dedup.claim_many(session, "Orders", [f"m-{i}" for i in range(5)])
    DeliveryCounter(store).fail("ORDERS", "m-0", "boom")
    assert dedup.purge(timedelta(hours=1), batch=batch) == 0, "none is an hour old"
    assert dedup.count() == 5
    assert dedup.purge(timedelta(0), batch=batch) == 5
    assert dedup.count() == 0
    assert DeliveryCounter(store).failures("ORDERS", "m-0") == 0, "the old counts go with them"
