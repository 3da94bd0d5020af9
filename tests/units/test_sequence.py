"""The commit sequence every unit of work follows (``units/sequence.py``), without a database.

The order is the guarantee: on PostgreSQL the dedup row is claimed before
the handler runs (a concurrent copy waits before any work); on SQLite it is
claimed last, after a short read; nothing commits after a rollback-only mark
or a transaction the database ended; a copy applied already stops the unit,
except in a container-managed batch, whose other messages go on.
"""

from __future__ import annotations

from typing import Any

import pytest

from mdbcontainer.state.dedup import DuplicateMessage
from mdbcontainer.units.sequence import (
    CLAIM,
    CRASH,
    HANDLE,
    READ,
    WRITE,
    Committed,
    Plan,
    RollbackOnly,
    commit_sequence,
)


def walk(plan: Plan, ids: list[str], *, applied: frozenset[str] = frozenset(),
         refused: frozenset[str] = frozenset(), rollback_only: bool = False,
         ) -> tuple[list[str], Committed]:
    """Drive the sequence as a runner would, answering each step; the steps met, and the result."""
    steps = commit_sequence(plan, ids)
    met: list[str] = []
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as done:
            return met, done.value
        met.append(f"{step.op}:{step.point}" if step.op is CRASH else step.op)
        reply = None
        if step.op is READ:
            reply = {i for i in step.ids or [] if i in applied}
        elif step.op is CLAIM:
            reply = {i for i in step.ids or [] if i not in refused}
        elif step.op is HANDLE:
            reply = (rollback_only, ["a send"])
        elif step.op is WRITE:
            reply = [f"row of {send}" for send in step.sends or []]


def test_postgresql_claims_before_the_handler_and_sqlite_after_it() -> None:
    first, committed = walk(Plan(once_only=True, claim_first=True), ["m"])
    assert first == ["begin", "claim", "handle", "crash:in-handler", "check", "write", "commit",
                     "crash:after-commit"]
    assert committed.fresh == ["m"] and committed.pending == ["row of a send"]
    last, _ = walk(Plan(once_only=True, claim_first=False), ["m"])
    assert last == ["read", "begin", "handle", "crash:in-handler", "check", "claim", "write",
                    "commit", "crash:after-commit"]


def test_a_batch_has_its_before_commit_point_and_a_bean_its_in_handler_point_outside() -> None:
    batch, _ = walk(Plan(once_only=False, claim_first=True, partial=True, batch=True), ["a", "b"])
    assert batch == ["begin", "handle", "crash:in-handler", "check", "write", "crash:before-commit",
                     "commit", "crash:after-commit"]
    bean, _ = walk(Plan(once_only=True, claim_first=True, bean=True), ["m"])
    assert "crash:in-handler" not in bean


@pytest.mark.parametrize("claim_first", [True, False])
def test_a_copy_applied_already_stops_one_message_and_leaves_a_batch_without_it(claim_first: bool) -> None:
    seen = {"applied": frozenset({"m"})} if not claim_first else {"refused": frozenset({"m"})}
    with pytest.raises(DuplicateMessage):
        walk(Plan(once_only=True, claim_first=claim_first), ["m"], **seen)
    _, committed = walk(Plan(once_only=True, claim_first=claim_first, partial=True, batch=True),
                        ["m", "n"], **seen)
    assert committed.fresh == ["n"]


def test_a_claim_refused_at_the_end_stops_even_a_batch() -> None:
    with pytest.raises(DuplicateMessage):
        walk(Plan(once_only=True, claim_first=False, partial=True, batch=True), ["m", "n"],
             refused=frozenset({"n"}))


def test_rollback_only_stops_before_the_check_and_the_commit() -> None:
    steps = commit_sequence(Plan(once_only=True, claim_first=True), ["m"])
    assert [steps.send(None).op, steps.send(None).op] == ["begin", "claim"]
    assert steps.send({"m"}).op == HANDLE
    assert steps.send((True, [])).point == "in-handler"
    with pytest.raises(RollbackOnly):
        steps.send(None)
