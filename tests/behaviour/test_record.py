"""The record (tests/record/run.py) and the proof that its checker sees a breach.

The checker's two tests share one small record infrastructure for the
module (one RabbitMQ node, a PostgreSQL primary alone: they make no broker,
database or link faults, and it starts in half the time): against a fleet with ``once_only = false`` killed right after a
commit (the crash point ``after-commit``, then restarted), the checker must
report the message applied twice; against a producer that counts a
message it never sent, it must report that message lost, and nothing else.
The short record (a fixed seed, 45 seconds of faults of every kind) builds its
own cluster and database pair and stops nothing of the machine's own services,
but it is ``disruptive`` all the same: it runs at the end of ``make test``,
because its three Erlang VMs and two PostgreSQL servers under faults load two
cores enough to push the tests beside it past their timeouts (a clean-clone
run with it beside them: two process timeouts, the suite's parallel part
585 s -> 874 s). The Makefile runs it beside the other disruptive tests, which
go one at a time and restart the machine's RabbitMQ, not its own (the
disruptive part: 141 s one after the other, 93 s so). ``make record`` runs a
long one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import cluster
from tests.record import postgres
from tests.record.infrastructure import Infrastructure
from tests.record.plan import Plan
from tests.record.run import Record, record

# Three Erlang VMs boot and join first (half a minute or more on two busy cores); one at a time.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hosts")]


def require() -> None:
    for why in (cluster.available(), postgres.available()):
        if why:
            if os.environ.get("MDB_REQUIRE_SERVICES"):
                pytest.fail(why)
            pytest.skip(why)


@pytest.fixture(scope="module")
def infra() -> Iterator[Infrastructure]:
    require()
    built = Infrastructure(synchronous=False, nodes=1, standby=False, test_host=False)
    try:
        yield built.start()
    finally:
        built.remove()


@pytest.mark.timeout(300)
def test_the_checker_reports_duplicates_when_once_only_is_off(infra: Infrastructure, tmp_path: Path) -> None:
    plan = Plan(seed=19, minutes=0.3, containers=2, faults=(), once_only=False,
                crash_at="after-commit@Work:20")
    result = Record(infra, plan, tmp_path).run()
    work = next(p for p in result.report.ports if p.port == "Work")
    assert work.duplicated, result.report.lines()
    assert not result.passed


@pytest.mark.timeout(300)
def test_the_checker_reports_a_message_counted_but_never_sent_as_lost(
        infra: Infrastructure, tmp_path: Path) -> None:
    plan = Plan(seed=23, minutes=0.2, containers=1, faults=(), phantoms=1, patience=10.0)
    result = Record(infra, plan, tmp_path).run()
    lost = [(p.port, m) for p in result.report.ports for m in p.lost]
    assert lost == [("Work", "Work-phantom-0")], result.report.lines()
    assert result.report.total("duplicated") == result.report.total("unexpected") == 0
    assert not result.passed


@pytest.mark.disruptive
@pytest.mark.timeout(600)
def test_short_record_loses_nothing_and_applies_nothing_twice() -> None:
    require()
    result = record(Plan(seed=33, minutes=0.75, mean_gap=5.0))
    assert result.passed, result.report.lines() + result.tally.findings
    assert sum(result.tally.faults.values()) >= 6, result.tally.faults
