"""The record: a seeded run of faults against a fleet, then what was lost, duplicated or reordered.

    python -m tests.record.run --seed N --minutes M [--replication async]     (make record)

The infrastructure is the run's own, beside the machine's services: a
3-node RabbitMQ cluster with quorum queues (tests/chaos/cluster.py), a
PostgreSQL primary with a streaming standby (tests/record/postgres.py),
synchronous by default, reached by a libpq multi-host URL with
``target_session_attrs=read-write``, and a test host (a network namespace,
tests/chaos/hosts.py) whose links can go silent.

The fleet: several ``mdb run`` processes (the last one on the test host),
each with every once-only port kind of ``plan.KINDS``: container-managed,
bean-managed, ``async def``, batched and ordered (``order_by`` a key of the
body, over partitions; section 16), the container-managed one sending each
message on to ``Downstream`` through the outbox. Two producers with
publisher confirms send to them at a steady rate and note every id the broker
confirmed; the ordered port's keys each have one producer. A writer outside
any handler (section 15) commits a business row and an ``Outbox.send`` to
``Outboxed`` in each of its own transactions, which the fleet's relay
publishes; one transaction in ten it rolls back, and that send must never
arrive.

The faults are drawn from the seed before the run and printed first: SIGKILL
of a container (restarted), SIGSTOP and SIGCONT of one, a broker node killed
and brought back, the test host's links cut silently, every database session
terminated, and the primary killed with the standby promoted and the old
primary rebuilt as the standby; about a quarter of them start together with
the one before. At the end the producers stop, every fault is healed, the
fleet drains, and the checker (tests/record/checker.py) prints per port and
in total lost, duplicated, unexpected, recovered and order violations; the
summary line comes last.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from mdbcontainer import Outbox
from mdbcontainer.sending.producer import Producer
from mdbcontainer.settings import load_settings
from mdbcontainer.testing import ContainerProcess, write_settings
from tests.conftest import CHILD_ENV, ROOT
from tests.record.checker import Report, Sent, check, committed
from tests.record.infrastructure import Infrastructure, infrastructure
from tests.record.plan import DOWNSTREAM, FAULTS, OUTBOXED, Fault, Plan, PortKind, schedule

# Every fault costs a SIGKILLed container's held messages one failed delivery (README:
# Guarantees); a long run must not back a good message out for them.
BACKOUT_THRESHOLD = 200
STALL = 60.0  # a producer gives a message up after this long unconfirmed
QUIET = 5.0  # the end: every confirmed message applied, and nothing changed for this long
SCHEMA = "rec"
SHORT = {"synchronous": "sync", "asynchronous": "async"}  # the summary line's words


@dataclass
class Tally:
    faults: Counter[str] = field(default_factory=Counter)
    failover_seconds: list[float] = field(default_factory=list)
    republished: int = 0
    rewritten: int = 0  # the outbox writer's transactions tried again after an error
    skipped: int = 0  # faults whose target was still busy with another when the run ended
    findings: list[str] = field(default_factory=list)


@dataclass
class Result:
    plan: Plan
    report: Report
    tally: Tally
    messages: int

    @property
    def passed(self) -> bool:
        return not self.report.broken and not self.tally.findings


class Record:
    """One run of a :class:`Plan` on an :class:`Infrastructure`."""

    def __init__(self, infra: Infrastructure, plan: Plan, folder: Path,
                 say: Callable[[str], None] = print) -> None:
        self.infra, self.plan, self.folder, self.say = infra, plan, folder, say
        self.rng = random.Random(plan.seed)
        self.tag = uuid.uuid4().hex[:6]
        self.schema = f"{SCHEMA}_{self.tag}"
        self.kinds = (*plan.kinds, DOWNSTREAM, *((OUTBOXED,) if plan.any_code else ()))
        self.queues = {k.port: f"rec-{self.tag}-{k.port.lower()}" for k in self.kinds}
        self.dlq = f"rec-{self.tag}-dlq"
        self.log = folder / "attempts.log"
        kinds = tuple(k for k in plan.faults if k != "link" or infra.host is not None)
        self.faults = schedule(plan, self.rng, kinds)
        self.sent: dict[str, Sent] = {}
        self.written: dict[str, Sent] = {}  # the outbox writer's sends, by message id
        self.tally = Tally()
        self.started = time.monotonic()
        self.locks = {name: threading.Lock() for name in ("broker", "database", "link")}
        self.container_locks = [threading.Lock() for _ in range(plan.containers)]
        self.stop_producing = threading.Event()

    @property
    def replication(self) -> str:
        database = self.infra.database
        if not database.with_standby:
            return "none (no standby)"
        return "synchronous" if database.synchronous else "asynchronous"

    # -- the run --------------------------------------------------------------

    def run(self) -> Result:
        p = self.plan
        self.say(f"record: seed {p.seed}, {p.minutes:g} minutes, {self.replication} replication, {p.containers} "
                 f"containers, ports {', '.join(k.port for k in self.kinds)}"
                 f"{'' if p.once_only else ', once_only = false'}; reproduce with: {p.reproduce}")
        self.say(f"schedule ({len(self.faults)} faults):")
        for fault in self.faults:
            self.say(f"  {fault.describe()}")
        self.engine = self.infra.database.engine()
        self._create_tables()
        self.fleet = [self._container(i) for i in range(p.containers)]
        try:
            for container in self.fleet:
                container.start(wait=False)
            for container in self.fleet:
                container.wait_started(120)
            self.started = time.monotonic()
            self._note("the fleet is up; producing")
            producers = [threading.Thread(target=self._produce, args=(k,), name=f"record-producer-{k}",
                                          daemon=True) for k in range(2)]
            if p.any_code:
                producers.append(threading.Thread(target=self._write, name="record-outbox-writer", daemon=True))
            for producer in producers:
                producer.start()
            self._inject()
            self.stop_producing.set()
            for producer in producers:
                producer.join(STALL + 10)
            self._note("producers done; healing and draining")
            self.infra.heal()
            self._drain()
            self._check_ports()
            report = self._check()
        finally:
            for container in self.fleet:
                self._end(container)
            self.engine.dispose()
        result = Result(p, report, self.tally, len(self.sent))
        self._summary(result)
        return result

    def _create_tables(self) -> None:
        from tests.apps import common

        with self.engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        md = MetaData(schema=self.schema)
        for table in common.metadata.tables.values():
            table.to_metadata(md, schema=self.schema)
        # The outbox writer's business rows: one per committed transaction, its send's id unique.
        self.orders = Table("orders", md, Column("id", Integer, primary_key=True, autoincrement=True),
                            Column("message_id", String(255), nullable=False, unique=True),
                            Column("n", Integer))
        md.create_all(self.engine)
        self.effects = md.tables[f"{self.schema}.effects"]

    def _container(self, index: int) -> ContainerProcess:
        remote = 0 < index == self.plan.containers - 1 and self.infra.host is not None
        ports = {k.port: {"destination": self.queues[k.port], "concurrency": 2, "prefetch": 10,
                          "max_retries": 10_000, "once_only": self.plan.once_only, **k.settings}
                 for k in self.kinds}
        queues: dict[str, Any] = {q: {"quorum": True, "backout_threshold": BACKOUT_THRESHOLD}
                                  for q in self.queues.values()}
        queues[self.dlq] = {"quorum": True}
        data = {"container": {
            "broker_url": self.infra.broker_url(remote), "database_url": self.infra.database_url(remote),
            "listeners": sorted({k.listener for k in self.kinds}), "dead_letter_queue": self.dlq,
            "db_schema": self.schema, "control_interval": "500ms", "shutdown_timeout": "20s",
            "heartbeat": "2s", "database_timeout": "5s", "connect_timeout": "5s",
        }, "ports": ports, "queues": queues}
        path = write_settings(self.folder / f"container{index}.toml", data)
        env = {"MDB_TEST_LOG": str(self.log), "MDB_TEST_SCHEMA": self.schema, **CHILD_ENV}
        if index == 0 and self.plan.crash_at:
            env |= {"MDB_CRASH_AT": self.plan.crash_at, "MDB_CRASH_ONCE_FILE": str(self.folder / "crashed")}
        prefix = self.infra.host.prefix if remote and self.infra.host else None
        return ContainerProcess(path, env=env, cwd=ROOT, prefix=prefix)

    def _note(self, what: str) -> None:
        self.say(f"[{time.monotonic() - self.started:6.1f}s] {what}")

    # -- producers ------------------------------------------------------------

    def _produce(self, index: int) -> None:
        """Every other message, at half the plan's rate; each sent until the broker confirms it."""
        settings = load_settings(self.fleet[0].settings_path, environ={})
        producer: Producer | None = None
        n, interval = index, 2.0 / self.plan.rate
        begun = time.monotonic()
        try:
            while not self.stop_producing.is_set():
                time.sleep(max(0.0, begun + (n // 2) * interval - time.monotonic()))
                kind = self.plan.kinds[n % len(self.plan.kinds)]
                message = Sent(kind.port, f"{kind.port}-{n:06d}", key=kind.key(n), seq=n)
                self.sent[message.message_id] = message
                producer = self._send(producer, settings, kind, n, message)
                n += 2
        finally:
            if producer is not None:
                producer.close()
            for k in range(self.plan.phantoms if index == 0 else 0):  # counted, never sent
                kind = self.plan.kinds[k % len(self.plan.kinds)]
                self.sent[f"{kind.port}-phantom-{k}"] = Sent(kind.port, f"{kind.port}-phantom-{k}",
                                                             confirmed=True)

    def _send(self, producer: Producer | None, settings: Any, kind: PortKind, n: int,
              message: Sent) -> Producer | None:
        deadline = time.monotonic() + STALL
        while time.monotonic() < deadline:
            message.attempts += 1
            try:
                producer = producer or Producer.from_settings(settings)
                producer.send(self.queues[kind.port], kind.body(n, self.queues),
                              message_id=message.message_id)
                message.confirmed = True
                return producer
            except Exception:
                if producer is not None:
                    with suppress(Exception):
                        producer.close()
                producer = None
                self.tally.republished += 1
                time.sleep(0.5)
        return producer  # given up: sent (maybe), never confirmed

    def _write(self) -> None:
        """Code outside any handler: a business row and its outbox send in one transaction, at one
        port's share of the rate; every tenth transaction also one rolled back after its send."""
        settings = load_settings(self.fleet[0].settings_path, environ={})
        outbox = Outbox.from_settings(settings)
        engine = self.infra.database.engine()  # the container's database_url: the outbox refuses another
        interval = len(self.plan.kinds) / self.plan.rate
        n, begun = 0, time.monotonic()
        try:
            while not self.stop_producing.is_set():
                time.sleep(max(0.0, begun + n * interval - time.monotonic()))
                message = Sent(OUTBOXED.port, f"{OUTBOXED.port}-{n:06d}")
                self.written[message.message_id] = message
                self._commit(engine, outbox, n, message)
                if n % 10 == 5:
                    self._roll_back(engine, outbox, n)
                n += 1
        finally:
            engine.dispose()

    def _commit(self, engine: Engine, outbox: Outbox, n: int, message: Sent) -> None:
        """Until the transaction is known committed: its COMMIT returned, or its row is there after an
        error (the answer lost, not the commit; a try again then fails on the unique id and looks)."""
        deadline = time.monotonic() + STALL
        while time.monotonic() < deadline:
            message.attempts += 1
            try:
                with Session(engine) as session, session.begin():
                    session.execute(self.orders.insert().values(message_id=message.message_id, n=n))
                    outbox.send(session, self.queues[OUTBOXED.port], {"n": n, "action": "ok"},
                                message_id=message.message_id)
                message.confirmed = True
                return
            except Exception:
                self.tally.rewritten += 1
                time.sleep(0.5)
                if self._business({message.message_id}):
                    message.confirmed = True
                    return
        # given up: committed or not, its row will say (checker.committed)

    def _roll_back(self, engine: Engine, outbox: Outbox, n: int) -> None:
        """A transaction that sends and rolls back: its message (never in ``written``) must not arrive."""
        message_id = f"{OUTBOXED.port}-rolledback-{n:06d}"
        with suppress(Exception), Session(engine) as session:
            session.begin()
            session.execute(self.orders.insert().values(message_id=message_id, n=n))
            outbox.send(session, self.queues[OUTBOXED.port], {"n": n, "action": "ok"}, message_id=message_id)
            session.rollback()

    def _business(self, among: set[str] | None = None) -> set[str]:
        """The message ids of the writer's committed business rows (``among`` them); none when unreadable."""
        query = select(self.orders.c.message_id)
        if among is not None:
            query = query.where(self.orders.c.message_id.in_(among))
        with suppress(Exception), self.engine.connect() as conn:
            return {str(m) for m in conn.execute(query).scalars()}
        return set()

    # -- faults ---------------------------------------------------------------

    def _inject(self) -> None:
        threads = []
        for fault in self.faults:
            while time.monotonic() - self.started < fault.at:
                self._watch()
                time.sleep(0.2)
            thread = threading.Thread(target=self._fault, args=(fault,), name=f"record-{fault.kind}")
            thread.start()
            threads.append(thread)
        while time.monotonic() - self.started < self.plan.seconds:
            self._watch()
            time.sleep(0.2)
        for thread in threads:
            thread.join(300)

    @contextmanager
    def _turn(self, lock: threading.Lock) -> Iterator[bool]:
        """Hold ``lock`` (one fault at a time on a target); False when the run ended meanwhile."""
        with lock:
            if time.monotonic() - self.started > self.plan.seconds:
                self.tally.skipped += 1
                yield False
            else:
                yield True

    def _fault(self, fault: Fault) -> None:
        try:
            before = self.tally.skipped
            getattr(self, f"_fault_{fault.kind}")(fault)
            if self.tally.skipped == before:
                self.tally.faults[fault.kind] += 1
        except Exception as exc:
            self.tally.findings.append(f"fault {fault.describe().strip()} failed: {exc}")
            self._note(f"fault {fault.kind} failed: {exc}")

    def _fault_kill(self, fault: Fault) -> None:
        container = self.fleet[fault.target]
        with self._turn(self.container_locks[fault.target]) as now:
            if not now:
                return
            self._note(f"SIGKILL container {fault.target} (pid {container.pid})")
            container.kill()
            time.sleep(fault.seconds)
            container.start(wait=False)

    def _fault_stop(self, fault: Fault) -> None:
        container = self.fleet[fault.target]
        with self._turn(self.container_locks[fault.target]) as now:
            if not now or not container.alive():
                return
            self._note(f"SIGSTOP container {fault.target} (pid {container.pid})")
            os.kill(container.pid, signal.SIGSTOP)
            try:
                time.sleep(fault.seconds)
            finally:
                os.kill(container.pid, signal.SIGCONT)
            self._note(f"SIGCONT container {fault.target}")

    def _fault_broker(self, fault: Fault) -> None:
        node = self.infra.cluster.nodes[fault.target]
        with self._turn(self.locks["broker"]) as now:  # one node down at a time: the queues keep a majority
            if not now:
                return
            self._note(f"SIGKILL broker node {node.name}")
            self.infra.cluster.kill(node)
            time.sleep(fault.seconds)
            self.infra.cluster.restart(node)
            self._note(f"broker node {node.name} back")

    def _fault_link(self, fault: Fault) -> None:
        assert self.infra.host is not None
        with self._turn(self.locks["link"]) as now:
            if not now:
                return
            self._note("the test host's links go silent")
            self.infra.host.cut()
            try:
                time.sleep(fault.seconds)
            finally:
                self.infra.host.heal()
            self._note("the test host's links carry packets again")

    def _fault_terminate(self, fault: Fault) -> None:
        with self._turn(self.locks["database"]) as now:
            if not now:
                return
            cut = self.infra.database.terminate_backends()
            self._note(f"pg_terminate_backend: {cut} sessions")

    def _fault_failover(self, fault: Fault) -> None:
        with self._turn(self.locks["database"]) as now:
            if not now:
                return
            old = self.infra.database.primary.port
            self._note(f"SIGKILL the primary ({old})")
            took = self.infra.database.fail_over()
            self.tally.failover_seconds.append(took)
            self._note(f"promoted {self.infra.database.primary.port} after {took:.1f}s; {old} rebuilt "
                       "as its standby")

    def _watch(self) -> None:
        """A container that exits by itself (not killed here) is a finding: note it, start it again."""
        for index, container in enumerate(self.fleet):
            lock = self.container_locks[index]
            if not lock.acquire(blocking=False):
                continue
            try:
                if container.proc is not None and container.proc.poll() is not None:
                    code = container.proc.returncode
                    self.tally.findings.append(f"container {index} exited by itself with {code}")
                    self._note(f"container {index} exited by itself with {code}; starting it again")
                    container.start(wait=False)
            finally:
                lock.release()

    # -- the end --------------------------------------------------------------

    def expected(self, business: set[str] | None = None) -> list[Sent]:
        """What the producers sent, what each message sent on through the outbox, and what the writer
        sent through it (with ``business``, its committed rows: each of those confirmed)."""
        out = list(self.sent.values())
        sends = {k.port: k.sends_to for k in self.plan.kinds if k.sends_to}
        out += [Sent(sends[m.port], f"{m.message_id}.out", m.attempts, m.confirmed)
                for m in self.sent.values() if m.port in sends and "phantom" not in m.message_id]
        written = list(self.written.values())
        return out + (committed(written, business) if business is not None else written)

    def applied(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(self.effects.c.port, self.effects.c.message_id)
                                .order_by(self.effects.c.id)).all()
        return [(str(port), str(message_id)) for port, message_id in rows]

    def _drain(self, timeout: float = 240.0) -> None:
        """Until every confirmed message is applied and nothing changed for QUIET s (or it stalls)."""
        wanted = {(m.port, m.message_id) for m in self.expected() if m.confirmed}
        deadline = time.monotonic() + timeout
        last: tuple[int, int] = (-1, -1)
        since = time.monotonic()
        while time.monotonic() < deadline:
            self._watch()
            with suppress(Exception):  # the database may still be catching up
                rows = self.applied()
                snapshot = (len(rows), len(wanted - set(rows)))
                if snapshot != last:
                    last, since = snapshot, time.monotonic()
                quiet = time.monotonic() - since
                if quiet >= (QUIET if snapshot[1] == 0 else self.plan.patience):
                    return
            time.sleep(0.5)

    def _check_ports(self) -> None:
        for index, container in enumerate(self.fleet):
            try:
                states = {r["port"]: r["state"] for r in container.rows()}
            except Exception as exc:
                self.tally.findings.append(f"container {index}: its ports could not be read: {exc}")
                continue
            down = {p: s for p, s in states.items() if s != "started"}
            if down or not states:
                self.tally.findings.append(f"container {index}: ports not started at the end: {down}")

    def _check(self) -> Report:
        attempts: Counter[tuple[str, str]] = Counter()
        if self.log.exists():
            for line in self.log.read_text().splitlines():
                port, message_id = line.split("\t")[:2]
                attempts[(port, message_id)] += 1
        return check(self.expected(self._business()), self.applied(), attempts,
                     ordered=[k.port for k in self.kinds if k.ordered], ports=[k.port for k in self.kinds])

    def _end(self, container: ContainerProcess) -> None:
        if not container.alive():
            return
        with suppress(ProcessLookupError):
            os.kill(container.pid, signal.SIGCONT)
        try:
            code = container.terminate(60)
        except subprocess.TimeoutExpired:
            container.kill()
            code = "no exit within 60 s"
        if code != 0:
            self.tally.findings.append(f"{container.settings_path.stem}: mdb run exited {code} on SIGTERM")

    def _summary(self, result: Result) -> None:
        for line in result.report.lines():
            self.say(line)
        for finding in result.tally.findings:
            self.say(f"finding: {finding}")
        p, t, r = self.plan, result.tally, result.report
        faults = ",".join(f"{k}:{t.faults[k]}" for k in FAULTS if t.faults[k]) or "none"
        faults += f" skipped={t.skipped}" if t.skipped else ""
        failover = (f" failover_max={max(t.failover_seconds):.1f}s" if t.failover_seconds else "")
        self.say(
            f"record seed={p.seed} minutes={p.minutes:g} replication={SHORT.get(self.replication, 'none')} "
            f"containers={p.containers} faults={faults}{failover} messages={result.messages} "
            f"confirmed={sum(m.confirmed for m in self.sent.values())} producer_retries={t.republished} "
            f"outbox_writes={len(self.written)} writer_retries={t.rewritten} "
            f"lost={r.total('lost')} duplicated={r.total('duplicated')} unexpected={r.total('unexpected')} "
            f"recovered={r.total('recovered')} order_violations={r.total('order_violations')} "
            f"result={'PASS' if result.passed else 'FAIL'}"
        )


def record(plan: Plan, say: Callable[[str], None] = print) -> Result:
    """A whole record: its own infrastructure, the run, the clean-up."""
    folder = Path(tempfile.mkdtemp(prefix="mdb-record-"))
    with infrastructure(plan.synchronous, say) as infra:
        result = Record(infra, plan, folder, say).run()
    say(f"record: logs in {folder}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.record.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="replay a record (default: random)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults come (default 10)")
    parser.add_argument("--replication", choices=("sync", "async"), default="sync",
                        help="the standby synchronous (nothing acknowledged is lost) or not")
    parser.add_argument("--containers", type=int, default=3, help="mdb run processes (default 3)")
    parser.add_argument("--mean-gap", type=float, default=30.0, help="seconds between faults (default 30)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    plan = Plan(seed, args.minutes, synchronous=args.replication == "sync", containers=args.containers,
                mean_gap=args.mean_gap)
    try:
        result = record(plan, say=lambda line: print(line, flush=True))
    except RuntimeError as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 1
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
