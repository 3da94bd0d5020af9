"""The record's checker on its own (tests/record/checker.py): each count from plain data."""

from __future__ import annotations

from collections import Counter

from tests.record.checker import Sent, check, committed


def sent(port: str, *ids: str, confirmed: bool = True, attempts: int = 1) -> list[Sent]:
    return [Sent(port, m, attempts=attempts, confirmed=confirmed) for m in ids]


def test_every_confirmed_message_applied_once_is_clean() -> None:
    report = check(sent("Work", "a", "b"), [("Work", "a"), ("Work", "b")])
    assert not report.broken
    assert report.lines()[-1].startswith("total: sent=2 confirmed=2 applied=2 lost=0 duplicated=0")


def test_confirmed_never_applied_is_lost_and_unconfirmed_never_applied_is_not() -> None:
    report = check([*sent("Work", "a", "b"), *sent("Work", "c", confirmed=False)], [("Work", "a")])
    [work] = report.ports
    assert work.lost == ["b"]
    assert report.broken


def test_applied_twice_is_duplicated_and_applied_unsent_is_unexpected() -> None:
    report = check(sent("Work", "a"), [("Work", "a"), ("Work", "a"), ("Work", "x"), ("Bean", "a")])
    work, bean = sorted(report.ports, key=lambda p: p.port, reverse=True)
    assert (work.duplicated, work.unexpected) == (["a"], ["x"])
    assert bean.unexpected == ["a"]  # sent to another port


def test_recovered_are_applied_once_after_a_fault_hit_them() -> None:
    messages = [*sent("Work", "retried", attempts=2), *sent("Work", "unconfirmed", confirmed=False),
                *sent("Work", "redelivered", "calm")]
    applied = [("Work", m) for m in ("retried", "unconfirmed", "redelivered", "calm")]
    report = check(messages, applied, Counter({("Work", "redelivered"): 2, ("Work", "calm"): 1}))
    assert sorted(report.ports[0].recovered) == ["redelivered", "retried", "unconfirmed"]
    assert not report.broken


def test_order_violations_per_key_on_ordered_ports_only() -> None:
    messages = [Sent("Ordered", f"k1-{i}", 1, True, "k1", i) for i in range(3)]
    messages += [Sent("Ordered", "k2-0", 1, True, "k2", 0)]
    applied = [("Ordered", "k1-0"), ("Ordered", "k1-2"), ("Ordered", "k2-0"), ("Ordered", "k1-1")]
    assert check(messages, applied, ordered=["Ordered"]).ports[0].order_violations == ["k1-1"]
    assert check(messages, applied).ports[0].order_violations == []


def test_an_ordered_port_counts_a_redelivered_message_by_its_first_application() -> None:
    """Applied again after a later message of its key, a message is duplicated, not also reordered."""
    messages = [Sent("Ordered", f"k1-{i}", 1, True, "k1", i) for i in range(2)]
    messages += [Sent("Ordered", f"k2-{i}", 1, True, "k2", 10 + i) for i in range(2)]
    applied = [("Ordered", m) for m in ("k2-0", "k1-0", "k1-1", "k2-1", "k1-0")]
    [ordered] = check(messages, applied, ordered=["Ordered"]).ports
    assert (ordered.duplicated, ordered.order_violations) == (["k1-0"], [])


def test_outbox_sends_are_owed_once_their_business_row_committed() -> None:
    """The writer's view and the database's rows: a commit whose answer was lost is owed all the same;
    a send told committed whose row is gone (an asynchronous failover) is lost; a rolled-back send
    that arrives is unexpected."""
    writes = [*sent("Outboxed", "told", "told-gone"), *sent("Outboxed", "unheard", "aborted", confirmed=False)]
    owed = committed(writes, ["told", "unheard"])
    assert [m.message_id for m in owed if m.confirmed] == ["told", "told-gone", "unheard"]
    report = check(owed, [("Outboxed", "told"), ("Outboxed", "rolledback-1")])
    [outboxed] = report.ports
    assert sorted(outboxed.lost) == ["told-gone", "unheard"]
    assert outboxed.unexpected == ["rolledback-1"]
    assert check(owed, [("Outboxed", m) for m in ("told", "told-gone", "unheard")]).broken is False
