"""Step by step: a bean-managed MDB that credits each transfer once and only once.

Run it: ``python samples/bmt_once_only/run.py`` (``--keep`` keeps the scratch directory).

1. Two transfers are credited; a producer's retry sends one of them again
   with the same message id: the dedup table skips it.
2. A third transfer's transaction commits and then the process dies before
   the broker hears the acknowledgment (the crash window the dedup table closes): the message
   is back on the queue.
3. The restarted container finds the message's dedup row and acknowledges it
   without calling the bean: every account is credited exactly once.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _support import Walk, main
from sqlalchemy import create_engine, text

from mdbcontainer.testing import QueueProbe

PORT = "CreditPort"
QUEUE = "CREDITS"


def walk_through(walk: Walk) -> None:
    walk.say("Start the container")
    container = walk.start()
    container.wait_started(PORT)

    walk.say("Credit alice 10 and bob 20; then the producer retries bob's transfer (same id)")
    walk.mdb("send", QUEUE, '{"account": "alice", "amount": 10}', "--id", "transfer-1")
    walk.mdb("send", QUEUE, '{"account": "bob", "amount": 20}', "--id", "transfer-2")
    walk.mdb("send", QUEUE, '{"account": "bob", "amount": 20}', "--id", "transfer-2")
    walk.wait_for(lambda: walk.ports()[PORT]["duplicate_skipped"] == 1, "the duplicate")
    show_port(walk)

    walk.say("Credit alice 5; the process dies after the commit, before the acknowledgment")
    walk.mdb("send", QUEUE, '{"account": "alice", "amount": 5, "crash_after_commit": true}',
             "--id", "transfer-3")
    walk.wait_for(lambda: container.proc.poll() is not None, "the crash")
    for line in container.lines("credit_listener"):
        walk.note(line)
    walk.note(f"mdb run exited with {container.proc.returncode} (SIGKILL)")
    waiting = QueueProbe(walk.settings).count(QUEUE)
    walk.expect(waiting == 1, f"transfer-3 is back on {QUEUE}, unacknowledged ({waiting} message)")
    walk.expect(credits(walk) == Counter(alice=15, bob=20), "yet its credit is committed")

    walk.say("Restart: the redelivered transfer-3 has its dedup row, so the bean is not called")
    container = walk.start(log_name="container-2.log")
    container.wait_started(PORT)
    walk.wait_for(lambda: QueueProbe(walk.settings).count(QUEUE) == 0, "the queue to drain")
    walk.wait_for(lambda: walk.ports()[PORT]["duplicate_skipped"] == 1, "the skip")
    show_port(walk)
    walk.expect(not container.lines("credited"), "the bean was not called again")
    balances = credits(walk)
    walk.note(f"balances: {dict(balances)}")
    walk.expect(balances == Counter(alice=15, bob=20), "alice 15, bob 20: every transfer once")
    walk.expect(container.terminate() == 0, "SIGTERM: the container stops cleanly")


def show_port(walk: Walk) -> None:
    row = walk.ports()[PORT]
    walk.note(f"mdb ports: {PORT} handled {row['handled']}, duplicate skipped "
              f"{row['duplicate_skipped']}, failed {row['failed']}")


def credits(walk: Walk) -> Counter[str]:
    """The committed credits per account, read from the container's database."""
    engine = create_engine(walk.settings.container.database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT account, amount FROM sample_credits")).all()
    finally:
        engine.dispose()
    total: Counter[str] = Counter()
    for account, amount in rows:
        total[account] += amount
    return total


if __name__ == "__main__":
    main(walk_through, __file__)
