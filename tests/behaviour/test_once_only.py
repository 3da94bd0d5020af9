"""Once and only once, proven by killing ``mdb run`` at every step of a delivery.

For every crash point of mdbcontainer/support/crash.py and both transaction kinds
(port ``Work``, container-managed; port ``Bean``, bean-managed), a container
with four consumers gets 300 messages, 20 of them published twice with the
same id, each making an outbox send to port ``Downstream`` (once-only CMT, in
the same container). The process is SIGKILLed at the point three times, each
time at a different hit (``MDB_CRASH_AT=point:K``), then restarted until
everything drained. A user would then see: every message's work committed
exactly once, every send consumed downstream exactly once, nothing lost,
nothing in the backout queue.

The crash at mid-backout needs a poison message: it goes to port ``Poison``
on a queue of its own with ``backout_threshold = 1``, sent once the work port
is busy, so each crash still hits work deliveries in flight. (With threshold 1
on the work queue itself, every good message a killed process had prefetched
would count one failed delivery and be backed out, as the contract says it
must.)

The matrix runs on RabbitMQ + PostgreSQL and on the embedded broker + SQLite;
each case takes about 8 to 12 seconds on a 2-core machine. Batched ports
(``batch_size = 10``, a per-message handler on port ``Work`` and a batch handler
on port ``BatchWork``) are killed at the points a batch adds.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from mdbcontainer.state.store import Tables
from mdbcontainer.support.crash import POINTS
from mdbcontainer.testing import ContainerProcess, wait_for
from tests.conftest import ROOT, Backend

pytestmark = pytest.mark.slow

# The points a delivery passes; mid-backout has a test of its own (it needs a
# poison message) and mid-replay belongs to ``mdb dlq replay``, not to mdb run.
DELIVERY_POINTS = ("before-handler", "in-handler", "after-commit", "after-ack", "outbox-dispatch")
assert {*DELIVERY_POINTS, "mid-backout"} <= set(POINTS), "a crash point was renamed"

DISTINCT = 280
TWICE = 20
# Hit numbers of the crash point, one per killed process. The points that every
# delivery passes (Downstream's too) are hit twice as often as outbox-dispatch.
CRASH_HITS = {"outbox-dispatch": (25, 8, 40)}
DEFAULT_HITS = (45, 15, 80)


@dataclass
class Run:
    """One case's queues, settings and the messages the producer sent."""

    backend: Backend
    port: str
    settings: Path
    work: str
    down: str
    poison: str
    ids: list[str]

    def container(self, **env: str) -> ContainerProcess:
        return ContainerProcess(self.settings, env={**self.backend.env, **env}, cwd=ROOT)

    def outbox_backlog(self) -> int:
        table = Tables.build(schema=self.backend.schema).outbox
        with self.backend.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)

    def drained(self) -> bool:
        """Every effect committed, no outbox row left, no message ready on either queue."""
        probe = self.backend.probe(self.settings)
        return (
            set(self.backend.effects(self.port)) == set(self.ids)
            and set(self.backend.effects("Downstream")) == {f"{i}.out" for i in self.ids}
            and self.outbox_backlog() == 0
            and probe.count(self.work) == 0
            and probe.count(self.down) == 0
            and probe.count(self.poison) == 0
        )


def setup_case(backend: Backend, port: str, batch_size: int = 1) -> Run:
    work, down, poison = backend.q("WORK"), backend.q("DOWN"), backend.q("POISON")
    consumers: dict[str, Any] = {"concurrency": 4, "prefetch": 10}
    if batch_size > 1:  # two consumers, each prefetching two batches
        consumers = {"concurrency": 2, "batch_size": batch_size, "batch_linger": "50ms"}
    if port in ("Work", "BatchWork"):
        consumers["transaction"] = "container"
    settings = backend.write(
        ports={
            port: {"destination": work, **consumers},
            "Downstream": {"destination": down, "concurrency": 2},
            "Poison": {"destination": poison},
        },
        # A crash counts one failed delivery against every message the killed
        # process held, prefetched ones included, and one message can be held by
        # every killed process in turn (three here; a graceful stop's hand-back
        # does not count). The default threshold of 5 would leave a margin of one
        # or two; 20 makes sure a good message is never backed out, which this
        # test would rightly report as lost.
        queues={work: {"backout_threshold": 20}, down: {"backout_threshold": 20},
                poison: {"backout_threshold": 1}},
        listeners=[f"tests.apps.{port.lower()}", "tests.apps.downstream", "tests.apps.poison"],
    )
    ids = [f"m-{i:03d}" for i in range(DISTINCT)]
    publish_with_duplicates(backend, settings, work, down, ids)
    return Run(backend, port, settings, work, down, poison, ids)


def publish_with_duplicates(backend: Backend, settings: Path, queue: str, down: str,
                            ids: list[str]) -> None:
    """Send every id once, and TWICE ids a second time, a little later in the queue."""
    order = list(ids)
    rng = random.Random(4)
    for message_id in rng.sample(ids, TWICE):
        later = order.index(message_id) + rng.randint(1, 60)
        order.insert(min(later, len(order)), message_id)
    with backend.producer(settings) as producer:
        for message_id in order:
            producer.send(queue, {"n": int(message_id[2:]), "action": "send", "to": down},
                          message_id=message_id)


def crash_once(run: Run, point: str, hit: int, poison_id: str | None = None) -> None:
    """Run a container that SIGKILLs itself at the ``hit``-th pass of ``point``."""
    container = run.container(MDB_CRASH_AT=f"{point}:{hit}").start(wait=False)
    try:
        if poison_id is not None:
            send_poison_mid_traffic(run, poison_id)
        code = container.wait_exit(90)
    except BaseException:
        container.kill()
        print(container.output()[-4000:])
        raise
    assert code == -signal.SIGKILL, (
        f"mdb run should have been killed at {point}:{hit}, exited {code}:\n"
        f"{container.output()[-3000:]}"
    )


def send_poison_mid_traffic(run: Run, poison_id: str) -> None:
    """Send a poison message once the work port is busy, so the crash hits deliveries in flight."""
    before = len(run.backend.effects(run.port))
    wait_for(lambda: len(run.backend.effects(run.port)) >= before + 10, timeout=60,
             what="the work port to make progress")
    with run.backend.producer(run.settings) as producer:
        producer.send(run.poison, {"n": -1, "action": "fail"}, message_id=poison_id)


def run_to_completion(run: Run) -> None:
    """A container without a crash point until everything drained, then a graceful stop."""
    with run.container() as container:
        wait_for(lambda: holds_twice(run.drained), timeout=90, interval=0.5,
                 what="the queues and the outbox to drain")
        assert container.terminate() == 0


def holds_twice(predicate: Callable[[], bool]) -> bool:
    """True now and half a second later: no relayed copy was still on its way."""
    if not predicate():
        return False
    time.sleep(0.5)
    return predicate()


def assert_once_and_only_once(run: Run) -> None:
    work = run.backend.effects(run.port)
    down = run.backend.effects("Downstream")
    assert sorted(work) == run.ids, "nothing lost"
    assert [i for i, n in work.items() if n > 1] == [], "no work committed twice"
    assert sorted(down) == [f"{i}.out" for i in run.ids], "every outbox send arrived"
    assert [i for i, n in down.items() if n > 1] == [], "no send applied twice downstream"
    assert run.outbox_backlog() == 0
    probe = run.backend.probe(run.settings)
    assert [probe.count(q) for q in (run.work, run.down, run.poison)] == [0, 0, 0], "all acknowledged"


def backed_out(run: Run) -> Counter[str]:
    dead = run.backend.probe(run.settings).take_all(run.backend.q("DLQ"))
    return Counter(str(m.properties["message_id"]) for m in dead)


@pytest.mark.parametrize("port", ["Work", "Bean"])
@pytest.mark.parametrize("point", DELIVERY_POINTS)
def test_crash_at_every_step_commits_each_message_once(backend: Backend, point: str,
                                                       port: str) -> None:
    started = time.monotonic()
    run = setup_case(backend, port)
    for hit in CRASH_HITS.get(point, DEFAULT_HITS):
        crash_once(run, point, hit)
    run_to_completion(run)
    assert_once_and_only_once(run)
    assert backed_out(run) == Counter(), "no good message in the backout queue"
    print(f"{backend.kind} {point} {port}: {time.monotonic() - started:.1f}s")


# The points a batch adds (README: Batches): before its commit, after it and before the
# acknowledgment, between acknowledgments (a duplicate acknowledged before the batch), and
# in the middle of publishing its outbox sends. Hit numbers are per batch here.
BATCH_POINTS = ("before-commit", "after-commit", "mid-acks", "outbox-dispatch")
assert set(BATCH_POINTS) <= set(POINTS), "a crash point was renamed"
# Two crashes a case keep the 16 cases near three minutes on a loaded 2-core machine.
BATCH_HITS = {"before-commit": (3, 2), "after-commit": (12, 4), "mid-acks": (1,),
              "outbox-dispatch": (3, 2)}


@pytest.mark.parametrize("port", ["Work", "BatchWork"])
@pytest.mark.parametrize("point", BATCH_POINTS)
def test_crash_in_a_batch_commits_each_message_once(backend: Backend, point: str, port: str) -> None:
    """Batches of 10 with a per-message handler (Work) and a batch handler (BatchWork)."""
    started = time.monotonic()
    run = setup_case(backend, port, batch_size=10)
    for hit in BATCH_HITS[point]:
        crash_once(run, point, hit)
    run_to_completion(run)
    assert_once_and_only_once(run)
    assert backed_out(run) == Counter(), "no good message in the backout queue"
    print(f"{backend.kind} batch {point} {port}: {time.monotonic() - started:.1f}s")


@pytest.mark.parametrize("port", ["Work", "Bean"])
def test_crash_mid_backout_keeps_the_poison_message_and_every_good_one(backend: Backend,
                                                                       port: str) -> None:
    started = time.monotonic()
    run = setup_case(backend, port)
    # The first process crashes at its first backout; each later one first backs
    # out the poison message the previous one died with, then crashes on a new one.
    for number, hit in enumerate((1, 2, 2), start=1):
        crash_once(run, "mid-backout", hit, poison_id=f"poison-{number}")
    run_to_completion(run)
    assert_once_and_only_once(run)
    dead = backed_out(run)
    assert set(dead) == {"poison-1", "poison-2", "poison-3"}, "no good message backed out"
    assert all(n >= 1 for n in dead.values()), "a poison message is never lost"
    assert run.backend.effects("Poison") == Counter()
    print(f"{backend.kind} mid-backout {port}: {time.monotonic() - started:.1f}s  backout copies {dict(dead)}")
