"""Once and only once, proven by killing ``mdb run`` at every step of a delivery.

For every crash point of mdbcontainer/support/crash.py, one container hosts a port
of each kind on a queue of its own: ``Work`` (container-managed transactions),
``Bean`` (bean-managed), ``AsyncWork`` and ``AsyncBean`` (the same with ``async
def`` handlers, tests/apps/async*.py), four consumers each. Every port gets 165
messages, 15 of them published twice with the same id, each making an outbox
send to port ``Downstream`` (once-only CMT, in the same container). The process
is SIGKILLed once per port, each time exactly at the point in a delivery of that
port (``MDB_CRASH_AT=point@Port:K``, the K-th hit on that port's consumers), at
a different hit each time; the other ports' deliveries are in flight wherever
the kill finds them, and each later process starts on the redeliveries the
previous one left (a port about to be killed with few of its messages left
gets more first). Then it is restarted until everything drained. A user would
then see: every message's work committed exactly once, every send consumed
downstream exactly once, nothing lost, nothing in the backout queue.

The crash at mid-backout needs a poison message: it goes to port ``Poison``
on a queue of its own with ``backout_threshold = 1``, sent once the work ports
are busy, so each crash still hits work deliveries in flight. (With threshold 1
on the work queues, every good message a killed process had prefetched would
count one failed delivery and be backed out, as the contract says it must.)

The matrix runs on RabbitMQ + PostgreSQL and on the embedded broker + SQLite.
Batched ports (``batch_size = 10``: a per-message handler on port ``Work``, a
batch handler on port ``BatchWork``, an async one on ``AsyncBatch``) are killed
at the points a batch adds, the same way.
"""

from __future__ import annotations

import random
import signal
import threading
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
DELIVERY_PORTS = ("Work", "Bean", "AsyncWork", "AsyncBean")
CONTAINER_MANAGED = {"Work", "BatchWork", "AsyncWork", "AsyncBatch"}

DISTINCT = 150
TWICE = 15
# The hit on the named port at which each killed process dies, in the order of
# DELIVERY_PORTS: the first process is killed among first deliveries, the later
# ones among the redeliveries the previous kill left. Each process lives until its
# port's hit while the other ports go on, so the port killed last must still have
# messages then: the async ports, the slowest (a quarter of the sync ports' pace
# while a process starts), come last and have done about 25 of their 165 messages
# when the last kill comes; the sync ports about 100.
DELIVERY_HITS = (20, 10, 12, 5)


@dataclass
class Run:
    """One case's ports and queues, its settings and the messages the producer sent."""

    backend: Backend
    ports: tuple[str, ...]
    settings: Path
    queues: dict[str, str]  # port -> its queue
    down: str
    poison: str
    ids: dict[str, list[str]]  # port -> the distinct message ids sent to it

    def container(self, **env: str) -> ContainerProcess:
        return ContainerProcess(self.settings, env={**self.backend.env, **env}, cwd=ROOT)

    def outbox_backlog(self) -> int:
        table = Tables.build(schema=self.backend.schema).outbox
        with self.backend.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)

    def work_done(self) -> int:
        """Committed work rows on the work ports, duplicates included."""
        return sum(n for i, n in self.backend.effects().items() if not i.endswith(".out"))

    def expected(self) -> set[str]:
        """Every message id of the work ports and of the sends they make downstream."""
        ids = {i for port in self.ports for i in self.ids[port]}
        return ids | {f"{i}.out" for i in ids}

    def drained(self) -> bool:
        """Every effect committed, no outbox row left, no message ready on any queue."""
        if set(self.backend.effects()) != self.expected() or self.outbox_backlog() != 0:
            return False
        probe = self.backend.probe(self.settings)
        return all(probe.count(q) == 0 for q in (*self.queues.values(), self.down, self.poison))


    def missing(self) -> str:
        """What a drain that never came still lacks: work and sends not committed, messages left."""
        done = self.backend.effects()
        lacking = sorted(self.expected() - set(done))
        probe = self.backend.probe(self.settings)
        left = {q: probe.count(q) for q in (*self.queues.values(), self.down, self.poison)}
        return (f"{len(lacking)} effects missing {lacking[:8]}, outbox rows {self.outbox_backlog()}, "
                f"ready messages {left}{self._in_flight()}, backed out {dict(backed_out(self))}")

    def _in_flight(self) -> str:
        """On SQS, the messages received and not deleted (held by a consumer, or lost by one)."""
        if self.backend.kind != "sqs":
            return ""
        from mdbcontainer.wire.sqs import sqs_name

        client = self.backend.sqs_client()
        held = {}
        for queue in (*self.queues.values(), self.down, self.poison):
            url = client.get_queue_url(QueueName=sqs_name(queue))["QueueUrl"]
            attributes = client.get_queue_attributes(
                QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])["Attributes"]
            held[queue] = int(attributes["ApproximateNumberOfMessagesNotVisible"])
        return f", in flight {held}"


def setup_case(backend: Backend, ports: tuple[str, ...], batch_size: int = 1, distinct: int = DISTINCT,
               twice: int = TWICE) -> Run:
    down, poison = backend.q("DOWN"), backend.q("POISON")
    queues = {port: backend.q(f"WORK-{port}") for port in ports}
    settings: dict[str, Any] = {}
    for port, queue in queues.items():
        consumers: dict[str, Any] = {"concurrency": 4, "prefetch": 10}
        if batch_size > 1:  # two consumers, each prefetching two batches
            consumers = {"concurrency": 2, "batch_size": batch_size, "batch_linger": "50ms"}
        if port in CONTAINER_MANAGED:
            consumers["transaction"] = "container"
        settings[port] = {"destination": queue, **consumers}
    path = backend.write(
        ports={
            **settings,
            "Downstream": {"destination": down, "concurrency": 4, "prefetch": 10},
            "Poison": {"destination": poison},
        },
        # A crash counts one failed delivery against every message the killed
        # process held, prefetched ones included, and one message can be held by
        # every killed process in turn (four here; a graceful stop's hand-back
        # does not count). The default threshold of 5 would leave a margin of one
        # at most; 20 makes sure a good message is never backed out, which this
        # test would rightly report as lost.
        queues={**{q: {"backout_threshold": 20} for q in (*queues.values(), down)},
                poison: {"backout_threshold": 1}},
        listeners=[*(f"tests.apps.{port.lower()}" for port in ports),
                   "tests.apps.downstream", "tests.apps.poison"],
        # The sends a killed process left in the outbox leave 1 s after it wrote them, not 5:
        # the last container's drain waits for them (README: outbox_relay_grace).
        outbox_relay_grace="1s",
    )
    run = Run(backend, ports, path, queues, down, poison, {port: [] for port in ports})
    for number, port in enumerate(ports):
        send_more(run, port, distinct, twice, spread=60, seed=number)
    return run


def send_more(run: Run, port: str, count: int, twice: int, spread: int, seed: int) -> None:
    """``count`` new ids to ``port``, ``twice`` of them a second time up to ``spread`` places later."""
    start = len(run.ids[port])
    ids = [f"{port}-{i:03d}" for i in range(start, start + count)]
    run.ids[port] += ids
    order = list(ids)
    rng = random.Random(seed)
    for message_id in rng.sample(ids, twice):
        later = order.index(message_id) + rng.randint(1, spread)
        order.insert(min(later, len(order)), message_id)
    with run.backend.producer(run.settings) as producer:
        for message_id in order:
            producer.send(run.queues[port], {"n": int(message_id[-3:]), "action": "send", "to": run.down},
                          message_id=message_id)


def crash_once(run: Run, spec: str, poison_id: str | None = None) -> None:
    """Run a container that SIGKILLs itself where ``spec`` (``MDB_CRASH_AT``) says."""
    container = run.container(MDB_CRASH_AT=spec).start(wait=False)
    try:
        if poison_id is not None:
            send_poison_mid_traffic(run, poison_id)
        code = container.wait_exit(90)
    except BaseException:
        container.kill()
        print(container.output()[-4000:])
        raise
    assert code == -signal.SIGKILL, (
        f"mdb run should have been killed at {spec}, exited {code}:\n{container.output()[-3000:]}"
    )
    done = Counter(i.rpartition("-")[0] for i in run.backend.effects() if not i.endswith(".out"))
    sent = {port: len(ids) for port, ids in run.ids.items()}
    print(f"killed at {spec}; messages done by port: {dict(done)} of {sent}")


def kill_each_port_at(run: Run, point: str | tuple[str, ...], hits: tuple[int, ...]) -> None:
    """One killed process per port, in order, each at the given hit of ``point`` on that port.

    ``point`` may name one point per port instead (the SQS matrix spreads points
    over its two ports).

    Each process lives until its port's hit while the other ports go on, and the
    pace of the ports differs from run to run (on the embedded broker the async
    ports do a quarter of the others' messages while a process starts; a batched
    port can lag two others that finish their queues meanwhile). A port about to
    be killed with fewer than 60 of its messages left gets 40 more first, so its
    hit still comes; at mid-acks, which only a duplicate in a batch reaches, it
    gets them in any case, 8 of them twice within the next batches.
    """
    points = (point,) * len(run.ports) if isinstance(point, str) else point
    for number, (port, at, hit) in enumerate(zip(run.ports, points, hits, strict=True)):
        left = len(set(run.ids[port]) - set(run.backend.effects(port)))
        if number > 0 and (left < 60 or at == "mid-acks"):
            send_more(run, port, 40, 8, spread=15, seed=100 + number)
        crash_once(run, f"{at}@{port}:{hit}")


def send_poison_mid_traffic(run: Run, poison_id: str) -> None:
    """Send a poison message once the work ports are busy, so the crash hits deliveries in flight."""
    before = run.work_done()
    wait_for(lambda: run.work_done() >= before + 10, timeout=60, what="the work ports to make progress")
    with run.backend.producer(run.settings) as producer:
        producer.send(run.poison, {"n": -1, "action": "fail"}, message_id=poison_id)


def run_to_completion(run: Run) -> None:
    """A container without a crash point until everything drained, then a graceful stop."""
    with run.container() as container:
        try:
            wait_for(lambda: holds_twice(run.drained), timeout=90, interval=0.5,
                     what="the queues and the outbox to drain")
        except AssertionError as timeout:
            raise AssertionError(f"{timeout}; {run.missing()}") from None
        assert container.terminate() == 0


def holds_twice(predicate: Callable[[], bool]) -> bool:
    """True now and half a second later: no relayed copy was still on its way."""
    if not predicate():
        return False
    time.sleep(0.5)
    return predicate()


def assert_once_and_only_once(run: Run) -> None:
    down = run.backend.effects("Downstream")
    for port in run.ports:
        work = run.backend.effects(port)
        assert sorted(work) == run.ids[port], f"nothing lost on {port}"
        assert [i for i, n in work.items() if n > 1] == [], f"no work committed twice on {port}"
        sent = {i: n for i, n in down.items() if i.startswith(f"{port}-")}
        assert sorted(sent) == [f"{i}.out" for i in run.ids[port]], f"every send of {port} arrived"
        assert [i for i, n in sent.items() if n > 1] == [], f"no send of {port} applied twice downstream"
    assert run.outbox_backlog() == 0
    probe = run.backend.probe(run.settings)
    left = {q: probe.count(q) for q in (*run.queues.values(), run.down, run.poison)}
    assert set(left.values()) == {0}, f"all acknowledged: {left}"


def backed_out(run: Run) -> Counter[str]:
    dead = run.backend.probe(run.settings).take_all(run.backend.q("DLQ"))
    return Counter(str(m.properties["message_id"]) for m in dead)


def test_a_crash_point_named_for_a_port_counts_and_kills_on_that_ports_consumers_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the matrix below relies on (``point@Port:K``, support/crash.py)."""
    from mdbcontainer.support import crash

    kills: list[str] = []
    monkeypatch.setenv("MDB_CRASH_AT", "in-handler@Work:2")
    monkeypatch.setattr(crash.os, "kill", lambda pid, sig: kills.append(threading.current_thread().name))
    crash.read_environment()
    try:
        for thread, point in [("mdb-AsyncWork-0", "in-handler"), ("mdb-Bean-1", "in-handler"),
                              ("mdb-Work-0", "after-commit"), ("MainThread", "in-handler"),
                              ("mdb-Work-0", "in-handler"), ("mdb-Bean-0", "in-handler"),
                              ("mdb-BatchWork-0", "in-handler"), ("mdb-Work-0-x", "in-handler"),
                              ("mdb-Work-1-batch_0", "in-handler"), ("mdb-Work-3", "in-handler")]:
            hit = threading.Thread(target=crash.crash_point, args=(point,), name=thread)
            hit.start()
            hit.join()
        assert kills == ["mdb-Work-1-batch_0", "mdb-Work-3"], (
            "from the second hit on a consumer of Work or its batch worker on, and only those")
    finally:
        monkeypatch.undo()
        crash.read_environment()


@pytest.mark.parametrize("point", DELIVERY_POINTS)
def test_crash_at_every_step_commits_each_message_once(backend: Backend, point: str) -> None:
    started = time.monotonic()
    run = setup_case(backend, DELIVERY_PORTS)
    kill_each_port_at(run, point, DELIVERY_HITS)
    run_to_completion(run)
    assert_once_and_only_once(run)
    assert backed_out(run) == Counter(), "no good message in the backout queue"
    print(f"{backend.kind} {point}: {time.monotonic() - started:.1f}s")


# The points a batch adds (README: Batches): before its commit, after it and before the
# acknowledgment, between acknowledgments (a duplicate acknowledged before the batch), and
# in the middle of publishing its outbox sends. Hit numbers count batches of the named port.
BATCH_POINTS = ("before-commit", "after-commit", "mid-acks", "outbox-dispatch")
assert set(BATCH_POINTS) <= set(POINTS), "a crash point was renamed"
BATCH_PORTS = ("Work", "BatchWork", "AsyncBatch")
BATCH_HITS = {"before-commit": (3, 2, 2), "after-commit": (3, 1, 2), "mid-acks": (1, 1, 1),
              "outbox-dispatch": (2, 3, 1)}


@pytest.mark.parametrize("point", BATCH_POINTS)
def test_crash_in_a_batch_commits_each_message_once(backend: Backend, point: str) -> None:
    """Batches of 10 with a per-message handler (Work) and batch handlers (BatchWork, AsyncBatch)."""
    started = time.monotonic()
    run = setup_case(backend, BATCH_PORTS, batch_size=10)
    kill_each_port_at(run, point, BATCH_HITS[point])
    run_to_completion(run)
    assert_once_and_only_once(run)
    assert backed_out(run) == Counter(), "no good message in the backout queue"
    print(f"{backend.kind} batch {point}: {time.monotonic() - started:.1f}s")


def test_crash_mid_backout_keeps_the_poison_message_and_every_good_one(backend: Backend) -> None:
    started = time.monotonic()
    run = setup_case(backend, ("Work", "Bean", "AsyncWork"))
    # The first process crashes at its first backout; each later one first backs
    # out the poison message the previous one died with, then crashes on a new one.
    for number, hit in enumerate((1, 2, 2), start=1):
        crash_once(run, f"mid-backout:{hit}", poison_id=f"poison-{number}")
    run_to_completion(run)
    assert_once_and_only_once(run)
    dead = backed_out(run)
    assert set(dead) == {"poison-1", "poison-2", "poison-3"}, "no good message backed out"
    assert all(n >= 1 for n in dead.values()), "a poison message is never lost"
    assert run.backend.effects("Poison") == Counter()
    print(f"{backend.kind} mid-backout: {time.monotonic() - started:.1f}s  backout copies {dict(dead)}")


# Amazon SQS (moto's server): the sync ports, each killed once, Work (container-managed) first,
# then Bean (bean-managed). A killed process's messages come back when their visibility timeout
# ends, so the queues are made with 3 s. Every delivery point is hit: the three where a
# redelivery meets work already committed or sends not yet relayed on both ports, the two
# others (before the handler; after the acknowledgment, which SQS sends as a batched
# DeleteMessage a killed process may not have sent) one port each, in one case.
SQS_PORTS = ("Work", "Bean")
SQS_HITS = (20, 10)
SQS_POINTS = (("in-handler",) * 2, ("after-commit",) * 2, ("outbox-dispatch",) * 2,
              ("before-handler", "after-ack"))
assert {p for pair in SQS_POINTS for p in pair} == set(DELIVERY_POINTS)


@pytest.mark.timeout(240)  # moto answers slower than a broker: 80 messages a port, and more time
@pytest.mark.parametrize("point", SQS_POINTS, ids="+".join)
def test_crash_at_every_step_on_sqs_commits_each_message_once(sqs: Backend,
                                                              point: tuple[str, str]) -> None:
    import boto3

    from mdbcontainer.wire.sqs import sqs_name

    started = time.monotonic()
    client = boto3.client("sqs")
    for name in (*(f"WORK-{port}" for port in SQS_PORTS), "DOWN", "POISON"):
        client.create_queue(QueueName=sqs_name(sqs.q(name)), Attributes={"VisibilityTimeout": "3"})
    run = setup_case(sqs, SQS_PORTS, distinct=80, twice=10)
    kill_each_port_at(run, point, SQS_HITS)
    run_to_completion(run)
    assert_once_and_only_once(run)
    assert backed_out(run) == Counter(), "no good message in the backout queue"
    print(f"sqs {'+'.join(point)}: {time.monotonic() - started:.1f}s")
