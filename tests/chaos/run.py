"""The chaos run: real faults against ``mdb run``, then proof that nothing was lost or applied twice.

    python -m tests.chaos.run [--full] [--seed N]       (make chaos: --full)

A producer sends the messages (1200; 5000 with ``--full``), some of them
twice with the same id, 1% poison (their handler always raises) and 2% flaky
(their first two deliveries fail, then they succeed), to the
listener ports of 4 consumers each in one ``mdb run``: ``Work``
(container-managed) and ``Bean`` (bean-managed), and in the short run also
their ``async def`` kinds ``AsyncWork`` and ``AsyncBean``, all once-only, each
handling a good message with a business row and an outbox send to one more
port, ``Downstream`` (once-only, container-managed). The work ports' queues
have a redelivery delay (with ``--full`` 1 s, doubling, at most 4 s; 0.5 s, then 1 s
in the test suite's runs), so a failed
message waits on a wait queue, through kills and broker faults too. Meanwhile the driver, at
random moments drawn from the seed, SIGKILLs the container and restarts it
(3 times; 10 with ``--full``), breaks the broker once (the short run closes
the container's own connections from the broker's side, so the tests running
beside it are untouched; ``--full`` restarts the RabbitMQ application), and
makes PostgreSQL refuse the container for 5 seconds once.

The moments are points of progress (a share of the expected business rows),
drawn at random in even slots, so every fault lands while messages flow and
a restarted container has handled what the previous one was killed holding
before the next fault comes.

At the end (everything drained and quiet) it prints one summary line and
fails unless: every good message's business row exists exactly once for its
port, every poison message is in the backout queue, every outbox send was
applied exactly once downstream, every port is started, and the container's
own tables agree (no outbox row left, the dedup rows are exactly the handled
ids per port, no port switched off), and no message is left waiting.

On Amazon SQS (``Plan.sqs``, tests/behaviour/test_chaos.py on moto's server
and PostgreSQL: 240 messages to the same four ports, 3 SIGKILLs, the
database outage) the broker fault is a cut of the endpoint for 2-5 s (the
container reaches moto through a forwarder, which stops), since moto keeps
its queues in memory and a restart would lose them; there is no wait queue:
SQS keeps a redelivery delay on the message (its visibility), so "nothing
left" there counts the messages in flight too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, select

from mdbcontainer.sending.producer import Producer
from mdbcontainer.settings import QueueSettings
from mdbcontainer.state.store import Tables
from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from mdbcontainer.wire.connection import transport_for
from mdbcontainer.wire.delays import wait_queues
from tests.chaos import faults
from tests.conftest import ROOT, Backend, reachable

PORTS = ("Work", "Bean")
ALL_PORTS = (*PORTS, "AsyncWork", "AsyncBean")  # the async kinds, tests/apps/async*.py
CONTAINER_MANAGED = {"Work", "AsyncWork"}  # the others are bean-managed
# A SIGKILL counts one failed delivery against every message the killed process
# held, prefetched ones included (README: Guarantees). Faults come a slot of
# progress apart, and what a killed process held comes first to the next one,
# so a good message is rarely caught by more than one or two kills: 8 leaves 7
# of margin before a good message would be backed out (and reported lost),
# while a poison message still leaves after 8 tries.
BACKOUT_THRESHOLD = 8
# Poison messages go back to the head of their queue and, after a restart,
# come first with everything the killed process held, so several of them can
# fail back to back: consecutive failures may pass the threshold. The port
# must not stop for that here (its stop is not what this run looks at).
MAX_RETRIES = 100
# Failed messages of Work and Bean wait on the broker: 1 s, 2 s, then 4 s each time in the
# full run. A poison message waits out every delay before its backout (about 23 s at these),
# and the runs in the test suite end when it is backed out: theirs wait 0.5 s, then 1 s.
DELAYS = {"redelivery_delay": "1s", "redelivery_backoff": 2.0, "redelivery_delay_max": "4s"}
SHORT_DELAYS = {"redelivery_delay": "500ms", "redelivery_backoff": 2.0, "redelivery_delay_max": "1s"}
CONCURRENCY = 4
PREFETCH = 10
STALL = 120.0  # no progress for this long fails the run
QUIET = 4.0  # the end: complete, and nothing changed for this long


class ChaosError(AssertionError):
    """The run could not go on (no progress, a container that would not start)."""


@dataclass(frozen=True)
class Plan:
    """What one run sends and which faults it injects."""

    seed: int
    messages: int
    kills: int
    # "close": the container's connections; "restart": stop_app/start_app; "cut": the endpoint
    # out of reach (the container reaches it through a forwarder, stopped for 2-5 s); "none"
    broker_fault: str
    rate: float  # messages per second from the producer
    duplicate_share: float = 0.02
    poison_share: float = 0.01
    flaky_share: float = 0.02  # good messages whose first two deliveries fail
    db_outage: float = 5.0
    # The work ports: Work and AsyncWork container-managed, Bean and AsyncBean bean-managed.
    ports: tuple[str, ...] = PORTS
    delays: dict[str, Any] = field(default_factory=lambda: dict(DELAYS))
    name: str = "short"  # what the first line calls the run
    # SQS: the visibility timeout (s) of the run's queues, made before the container starts. What a
    # killed container held comes back after it (a broker gives it back as the connection drops).
    visibility_timeout: int | None = None
    concurrency: int = CONCURRENCY  # consumers of each port

    @classmethod
    def short(cls, seed: int, ports: tuple[str, ...] = ALL_PORTS) -> Plan:
        return cls(seed, 1200, 3, "close", rate=48.0, ports=ports, delays=dict(SHORT_DELAYS))

    @classmethod
    def full(cls, seed: int) -> Plan:
        return cls(seed, 5000, 10, "restart", rate=50.0, name="full")

    @classmethod
    def sqs(cls, seed: int) -> Plan:
        """The short run on Amazon SQS (moto's server): 240 messages, 3 kills, the database outage.

        The broker fault is a cut: moto keeps its queues in memory, so restarting it would lose
        them (and every message on them), and it has no connections of its own to close (each SQS
        call is an HTTP request), so the container reaches it through a forwarder, stopped for
        2-5 s (every call fails, open ones are cut) while the producer goes on. Fewer messages than on RabbitMQ: moto answers a call in milliseconds,
        not microseconds. A killed container's messages come back after the queues' visibility
        timeout, 5 s (the container extends it for what it holds every third of that). A redelivery delay
        is the message's visibility (0.5 s rounds to 0 on SQS, which counts whole seconds).
        Two consumers a port, not four: each idle consumer polls moto, whose CPU the test suite's
        other tests share.
        """
        return cls(seed, 240, 3, "cut", rate=16.0, delays=dict(SHORT_DELAYS), name="sqs",
                   ports=ALL_PORTS, visibility_timeout=5, concurrency=2)

    @classmethod
    def restart(cls, seed: int) -> Plan:
        """The full run's faults (a RabbitMQ restart beside a SIGKILL) at 600 messages and 1 kill:
        the test suite's run, where the whole suite waits on it (the short run already kills three
        times; this one is here for the restart); ``make chaos`` runs the full one."""
        return cls(seed, 600, 1, "restart", rate=50.0, delays=dict(SHORT_DELAYS), name="restart")


@dataclass
class Workload:
    """The messages: which port each goes to, which are poison, which are sent twice, in what order."""

    queues: dict[str, str]
    down: str
    port_of: dict[str, str]
    poison: set[str]
    duplicated: list[str]
    order: list[str]
    flaky: set[str] = field(default_factory=set)
    ports: tuple[str, ...] = PORTS

    def body(self, message_id: str) -> dict[str, Any]:
        n = int(message_id[2:])
        if message_id in self.poison:
            return {"n": n, "action": "fail"}
        if message_id in self.flaky:
            return {"n": n, "action": "send", "to": self.down, "fail_first": 2}
        return {"n": n, "action": "send", "to": self.down}

    def good(self, port: str) -> set[str]:
        return {m for m, p in self.port_of.items() if p == port and m not in self.poison}

    def downstream(self) -> set[str]:
        return {f"{m}.out" for m in self.port_of if m not in self.poison}

    @property
    def expected_rows(self) -> int:
        return sum(len(self.good(p)) for p in self.ports) + len(self.downstream())


def make_workload(plan: Plan, rng: random.Random, queues: dict[str, str], down: str) -> Workload:
    ids = [f"c-{i:05d}" for i in range(plan.messages)]
    port_of = {m: plan.ports[i % len(plan.ports)] for i, m in enumerate(ids)}
    poison = set(rng.sample(ids, round(plan.messages * plan.poison_share)))
    duplicated = rng.sample(ids, round(plan.messages * plan.duplicate_share))
    order = list(ids)
    for message_id in duplicated:  # the second copy a little later in the stream
        order.insert(min(len(order), order.index(message_id) + rng.randint(1, 200)), message_id)
    # Flaky ones are sent once: two copies would share (and double) their failures.
    others = sorted(set(ids) - poison - set(duplicated))
    flaky = set(rng.sample(others, round(plan.messages * plan.flaky_share)))
    return Workload(queues, down, port_of, poison, duplicated, order, flaky, plan.ports)


@dataclass
class Tally:
    kills: int = 0
    broker_restarts: int = 0
    broker_closes: int = 0
    broker_cuts: int = 0
    db_outages: int = 0
    republished: int = 0
    unexpected_exits: list[str] = field(default_factory=list)

    @property
    def broker_outages(self) -> int:
        """Each broker fault is one outage, which the container logs once."""
        return self.broker_restarts + self.broker_closes + self.broker_cuts


class ChaosRun:
    """One run on a PostgreSQL backend (tests/conftest.py's Backend): RabbitMQ, or SQS with
    ``Plan.sqs`` (the endpoint cut, no wait queues: SQS keeps a delay on the message itself)."""

    def __init__(self, backend: Backend, plan: Plan, say: Callable[[str], None] = print) -> None:
        self.backend = backend
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self.say = say
        self.tally = Tally()
        self.role = faults.DatabaseRole()
        self.started = time.monotonic()
        queues = {p: backend.q(p.upper()) for p in plan.ports}
        self.workload = make_workload(plan, self.rng, queues, backend.q("DOWN"))
        self.tables = Tables.build(schema=backend.schema)
        self._produced = threading.Event()
        self._producer_error: list[str] = []
        self.findings: list[str] = []  # checks made on the way, reported at the end
        self.waits: list[str] = []  # the wait queues of the work ports' queues
        self.forwarder: faults.Forwarder | None = None  # the container's way to SQS (plan "cut")

    # -- the run ------------------------------------------------------------

    def run(self) -> list[str]:
        """Run the plan; return the failures (empty when every check held). Prints the summary.

        The whole run holds /tmp/mdb-disruptive.lock: exclusively when it
        restarts the broker, shared otherwise, so that no other run stops a
        service meanwhile (its checks count the outages it caused).
        """
        stops = self.plan.broker_fault == "restart"
        self.say(f"chaos: seed {self.plan.seed} ({self.plan.name} run; "
                 f"reproduce with --seed {self.plan.seed} or MDB_CHAOS_SEED={self.plan.seed})")
        with faults.disruptive_lock(shared=not stops):
            self.started = time.monotonic()
            try:
                failures = self._run()
            except ChaosError as exc:
                failures = [str(exc)]
        self._summary(failures)
        return failures

    def _run(self) -> list[str]:
        self.role.create()
        self._create_sqs_queues()
        self.settings = self._write_settings()
        env = dict(self.backend.env)
        if self.plan.broker_fault == "cut":
            self.forwarder = faults.Forwarder(int(urlsplit(env["AWS_ENDPOINT_URL"]).port or 80))
            self.forwarder.start()
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{self.forwarder.port}"
        self.container = ContainerProcess(self.settings, env=env, cwd=ROOT)
        try:
            producer = threading.Thread(target=self._produce, name="chaos-producer", daemon=True)
            producer.start()
            self.container.start(timeout=60)
            self._inject_faults()
            producer.join(300)
            self._drain()
            return self._verify() + self._stop_gracefully()
        finally:
            if self.container.alive():
                self.container.kill()
            if self.forwarder is not None:
                self.forwarder.stop()
            self.role.drop()

    def _write_settings(self) -> Path:
        w = self.workload
        ports: dict[str, Any] = {
            p: {"destination": w.queues[p], "concurrency": self.plan.concurrency, "prefetch": PREFETCH,
                "max_retries": MAX_RETRIES, "transaction": "container" if p in CONTAINER_MANAGED else "bean"}
            for p in w.ports
        }
        ports["Downstream"] = {"destination": w.down, "concurrency": self.plan.concurrency,
                               "prefetch": PREFETCH, "max_retries": MAX_RETRIES}
        queues = {q: {"backout_threshold": BACKOUT_THRESHOLD} for q in [*w.queues.values(), w.down]}
        for queue in w.queues.values():
            queues[queue].update(self.plan.delays)
        path = self.backend.write(ports=ports, queues=queues, database_url=self.role.url,
                                  connect_timeout="5s")
        if not transport_for(self.backend.settings(path), self.backend.broker_url).capabilities.postpones:
            for queue in w.queues.values():  # SQS keeps a delay on the message: no wait queues there
                self.waits += wait_queues(queue, QueueSettings(**queues[queue]))
        self.backend.queues.update(self.waits)  # removed at the end with the others
        return path

    def _create_sqs_queues(self) -> None:
        """On SQS, the run's queues with the plan's short visibility timeout, before the container
        would make them with SQS's default of 30 s (it keeps a queue's attributes)."""
        if self.plan.visibility_timeout is None:
            return
        from mdbcontainer.wire.sqs import sqs_name

        client = self.backend.sqs_client()
        for queue in (*self.workload.queues.values(), self.workload.down, self.backend.q("DLQ")):
            client.create_queue(QueueName=sqs_name(queue),
                                Attributes={"VisibilityTimeout": str(self.plan.visibility_timeout)})

    def _produce(self) -> None:
        """Send every message at the plan's rate, retrying through broker faults.

        The rate keeps messages flowing for the whole fault schedule (the
        container drains a full queue of 1000 in a few seconds, faster than
        the faults can come); each fault leaves a backlog the container then
        works off at full prefetch. A retry may publish a copy more.
        """
        begun = time.monotonic()
        self._producer: Producer | None = None
        try:
            for index, message_id in enumerate(self.workload.order):
                time.sleep(max(0.0, begun + index / self.plan.rate - time.monotonic()))
                if not self._send(message_id):
                    return
        finally:
            if self._producer is not None:
                self._producer.close()
            self._produced.set()

    def _send(self, message_id: str) -> bool:
        queue = self.workload.queues[self.workload.port_of[message_id]]
        deadline = time.monotonic() + STALL
        while True:
            try:
                self._producer = self._producer or self.backend.producer(self.settings)
                self._producer.send(queue, self.workload.body(message_id), message_id=message_id)
                return True
            except Exception as exc:
                if time.monotonic() > deadline:
                    self._producer_error.append(f"the producer gave up on {message_id}: {exc}")
                    return False
                if self._producer is not None:
                    self._producer.close()
                self._producer = None
                self.tally.republished += 1
                time.sleep(0.5)

    # -- faults -------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str]]:
        """Each fault at a random point of progress in its own slot of 5%..85% of the rows.

        The producer's rate sets the pace; a restart takes a second or two,
        and the backlog it leaves is worked off before the next slot.
        """
        events = ["kill"] * self.plan.kills + ["database"] + ([] if self.plan.broker_fault == "none" else ["broker"])
        self.rng.shuffle(events)
        low, high = 0.05, 0.85
        slot = (high - low) / len(events)
        return [(low + slot * (i + self.rng.uniform(0.2, 0.8)), event) for i, event in enumerate(events)]

    def _inject_faults(self) -> None:
        total = self.workload.expected_rows
        for point, event in self.schedule():
            self._wait_for_rows(int(point * total))
            time.sleep(self.rng.uniform(0.0, 1.5))  # after a restart: from start-up to steady flow
            getattr(self, f"_fault_{event}")()

    def _log(self, what: str) -> None:
        self.say(f"[{time.monotonic() - self.started:6.1f}s] {what} at {self.rows()}/"
                 f"{self.workload.expected_rows} rows")

    def _fault_kill(self) -> None:
        pid = self.container.pid
        self._log(f"SIGKILL {self.tally.kills + 1}/{self.plan.kills} (pid {pid})")
        self.container.kill()
        self.tally.kills += 1
        time.sleep(self.rng.uniform(0.0, 1.0))
        self._start()

    def _fault_broker(self) -> None:
        if self.plan.broker_fault == "restart":
            self._log("rabbitmqctl stop_app")
            down = faults.restart_broker_app(self.rng.uniform(2.0, 5.0))
            self.tally.broker_restarts += 1
            self._log(f"rabbitmqctl start_app done (the broker was down {down:.1f}s)")
        elif self.plan.broker_fault == "cut":
            assert self.forwarder is not None
            pause = self.rng.uniform(2.0, 5.0)
            self._log(f"the broker's endpoint out of reach for {pause:.1f}s")
            self.forwarder.stop()
            time.sleep(pause)
            self.forwarder.start()
            self.tally.broker_cuts += 1
            self._log("the broker's endpoint in reach again")
        else:
            self._log("closing the container's broker connections")
            closed = faults.close_broker_connections(self.container.pid)
            self.tally.broker_closes += 1
            self._log(f"closed {closed} broker connections")
        broker_faults = self.tally.broker_outages
        self._wait_for_line("broker connection restored", broker_faults)
        self._wait_started(120)
        self._log("every port started again")

    def _fault_database(self) -> None:
        self._log(f"PostgreSQL refuses {self.role.name} for {self.plan.db_outage:g}s")
        cut = self.role.outage(self.plan.db_outage)
        self.tally.db_outages += 1
        self._log(f"PostgreSQL accepts {self.role.name} again ({cut} sessions were cut)")
        self._wait_for_line("database connection restored", self.tally.db_outages)

    def _wait_for_line(self, line: str, count: int) -> None:
        """Before the next fault, so that the container's line belongs to this outage."""
        try:
            wait_for(lambda: self.container.output().count(line) >= count, timeout=60,
                     what=f"the container to log {line!r}")
        except AssertionError as exc:
            self.findings.append(str(exc))

    def _start(self) -> None:
        self.container.start(wait=False)
        self._wait_started(60)

    def _wait_started(self, timeout: float) -> None:
        try:
            self.container.wait_started(timeout)
        except AssertionError as exc:
            tail = self.container.output()[-3000:]
            raise ChaosError(f"the container did not start: {exc}\n{tail}") from None

    def _ensure_running(self) -> None:
        """A container that exits by itself (not killed here) is a finding: note it and restart it."""
        if self.container.alive():
            return
        assert self.container.proc is not None
        code = self.container.proc.returncode
        self.tally.unexpected_exits.append(f"mdb run exited by itself with {code}")
        self._log(f"mdb run exited by itself with {code}; restarting it")
        self._start()

    def rows(self) -> int:
        table = self.backend.metadata.tables[f"{self.backend.schema}.effects"]
        with self.backend.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)

    def _wait_for_rows(self, target: int) -> None:
        last, since = -1, time.monotonic()
        while True:
            self._ensure_running()
            now = self.rows()
            if now >= target:
                return
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > STALL:
                raise ChaosError(f"no progress for {STALL:g}s at {now}/{target} rows\n"
                                 f"{self.container.output()[-3000:]}")
            time.sleep(0.2)

    # -- the end ------------------------------------------------------------

    def _queues(self) -> list[str]:
        return [*self.workload.queues.values(), self.workload.down]

    def _snapshot(self) -> tuple[int, ...]:
        """Rows, outbox rows, then per queue what is ready, waiting and (SQS) in flight; the DLQ last.

        What is in flight is asked only once nothing is ready or waiting: on SQS, each count is
        a request to moto, which the container's own requests wait behind.
        """
        probe = self.backend.probe(self.settings)
        snap = (self.rows(), self._outbox_rows(), *(probe.count(q) for q in [*self._queues(), *self.waits]))
        flying = tuple(self.backend.in_flight(q) for q in self._queues()) if not any(snap[1:]) else (-1,)
        return (*snap, *flying, probe.count(self.backend.q("DLQ")))

    def _drain(self, timeout: float = 240.0) -> None:
        """Wait until every row is there, the queues and outbox are empty and nothing changes."""
        self._produced.wait(STALL)
        self._ensure_running()
        self._wait_started(60)
        deadline = time.monotonic() + timeout
        last: tuple[int, ...] = ()
        since = time.monotonic()
        while time.monotonic() < deadline:
            self._ensure_running()
            snap = self._snapshot()
            if snap != last:
                last, since = snap, time.monotonic()
            quiet = time.monotonic() - since
            empty = not any(snap[1:-1])  # no outbox row, nothing ready, waiting or in flight on the queues
            complete = snap[0] >= self.workload.expected_rows
            if empty and quiet >= (QUIET if complete else 30.0):  # incomplete: the checks say what is missing
                return
            time.sleep(0.5)

    def _outbox_rows(self) -> int:
        with self.backend.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(self.tables.outbox)).scalar() or 0)

    def _verify(self) -> list[str]:
        failures = [*self._producer_error, *self.findings, *self._verify_outage_lines()]
        failures += [f"{e} (a container must keep running through faults)"
                     for e in self.tally.unexpected_exits]
        for port in self.workload.ports:
            failures += exactly_once(port, self.backend.effects(port), self.workload.good(port))
        failures += exactly_once("Downstream", self.backend.effects("Downstream"), self.workload.downstream())
        failures += self._verify_backout()
        probe = self.backend.probe(self.settings)
        failures += [f"{n} message(s) still waiting on {q}" for q in self.waits if (n := probe.count(q))]
        failures += [f"{n} message(s) still in flight on {q} (held, or hidden by a delay)"
                     for q in self._queues() if (n := self.backend.in_flight(q))]
        failures += self._verify_ports()
        failures += self._verify_tables()
        return failures

    def _verify_outage_lines(self) -> list[str]:
        """README, Guarantees: an outage is logged once, not once per message or consumer."""
        log = self.container.output()
        t = self.tally
        out = []
        for kind, outages in (("database", t.db_outages), ("broker", t.broker_outages)):
            lines = (log.count(f"{kind} unavailable ("), log.count(f"{kind} connection restored"))
            if lines != (outages, outages):
                out.append(f"{lines[0]} '{kind} unavailable' and {lines[1]} '{kind} connection "
                           f"restored' lines for {outages} {kind} outage(s)")
        return out

    def _verify_backout(self) -> list[str]:
        self.dead = Counter(str(m.properties.get("message_id"))
                            for m in self.backend.probe(self.settings).take_all(self.backend.q("DLQ")))
        missing = sorted(self.workload.poison - set(self.dead))
        good = sorted(set(self.dead) - self.workload.poison)
        out = []
        if missing:
            out.append(f"{len(missing)} poison message(s) not in the backout queue: {missing[:10]}")
        if good:
            out.append(f"{len(good)} good message(s) backed out: {good[:10]}")
        return out

    def _verify_ports(self) -> list[str]:
        done = mdb("ports", "--json", settings=self.settings, env=self.backend.env)
        if done.returncode != 0:
            return [f"mdb ports --json failed: {done.stderr.strip()}"]
        mine = [r for r in json.loads(done.stdout) if f":{self.container.pid}:" in r["container"]]
        states = {r["port"]: (r["state"], r["reason"]) for r in mine}
        return [f"port {p} is {states.get(p, ('missing', ''))[0]} at the end: {states.get(p, ('', ''))[1]}"
                for p in (*self.workload.ports, "Downstream") if states.get(p, ("missing",))[0] != "started"]

    def _verify_tables(self) -> list[str]:
        t = self.tables
        out = []
        with self.backend.engine.connect() as conn:
            outbox = conn.execute(select(func.count()).select_from(t.outbox)).scalar()
            dedup = conn.execute(select(t.dedup.c.port, t.dedup.c.message_id)).all()
            stopped = conn.execute(select(t.port.c.name, t.port.c.reason)
                                   .where(t.port.c.state == "stopped")).all()
        if outbox:
            out.append(f"{outbox} outbox row(s) left")
        for port in (*self.workload.ports, "Downstream"):
            marked = {m for p, m in dedup if p == port}
            handled = set(self.backend.effects(port))
            if marked != handled:
                out.append(f"port {port}: dedup rows differ from handled ids: {len(marked - handled)} "
                           f"without work, {len(handled - marked)} without a dedup row")
        out += [f"port {name} switched off in the fleet table: {reason}" for name, reason in stopped]
        return out

    def _stop_gracefully(self) -> list[str]:
        code = self.container.terminate(60)
        return [] if code == 0 else [f"mdb run exited {code} on SIGTERM at the end"]

    # -- the report ---------------------------------------------------------

    def _summary(self, failures: list[str]) -> None:
        w, t = self.workload, self.tally
        attempts = [a for a in self.backend.attempts() if a[1] not in w.poison and a[0] != "Downstream"]
        log = self.container.output()
        self.say(f"max redelivery count seen by a good message's handler: "
                 f"{max((a[3] for a in attempts), default=0)} (threshold {BACKOUT_THRESHOLD}); "
                 f"handler attempts {len(self.backend.attempts())}; producer retries {t.republished}; "
                 f"outage lines: database {log.count('database unavailable (')}/"
                 f"{log.count('database connection restored')}, broker {log.count('broker unavailable (')}/"
                 f"{log.count('broker connection restored')} (unavailable/restored); "
                 f"log {self.container.log_path}")
        for failure in failures:
            self.say(f"FAILED: {failure}")
        handled = sum(len(set(self.backend.effects(p)) & w.good(p)) for p in w.ports)
        self.say(
            f"chaos seed={self.plan.seed} messages={self.plan.messages} duplicates={len(w.duplicated)} "
            f"poison={len(w.poison)} flaky={len(w.flaky)} kills={t.kills} broker_restarts={t.broker_restarts} "
            f"broker_closes={t.broker_closes} broker_cuts={t.broker_cuts} db_outages={t.db_outages} handled={handled} "
            f"backed_out={sum(self.dead.values()) if hasattr(self, 'dead') else 0} "
            f"downstream={len(self.backend.effects('Downstream'))} "
            f"elapsed={time.monotonic() - self.started:.1f}s result={'FAIL' if failures else 'PASS'}"
        )


def exactly_once(port: str, rows: Counter[str], expected: set[str]) -> list[str]:
    """The business rows of ``port``: every expected id once, nothing else."""
    out = []
    missing = sorted(expected - set(rows))
    twice = sorted(m for m, n in rows.items() if n > 1)
    extra = sorted(set(rows) - expected)
    if missing:
        out.append(f"port {port}: {len(missing)} message(s) lost (no business row): {missing[:10]}")
    if twice:
        out.append(f"port {port}: {len(twice)} message(s) applied twice: {twice[:10]}")
    if extra:
        out.append(f"port {port}: {len(extra)} unexpected row(s): {extra[:10]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="5000 messages, 10 kills, a RabbitMQ restart")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    plan = Plan.full(seed) if args.full else Plan.short(seed)
    for port, name in ((5672, "RabbitMQ"), (5432, "PostgreSQL")):
        if not reachable(port):
            print(f"chaos: {name} is not reachable on 127.0.0.1:{port}", file=sys.stderr)
            return 1
    workdir = Path(tempfile.mkdtemp(prefix="mdb-chaos-"))
    backend = Backend("rabbitmq", workdir)
    try:
        failures = ChaosRun(backend, plan, say=lambda line: print(line, flush=True)).run()
    finally:
        backend.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
