"""What a record runs: its port kinds, its plan, and its faults drawn from the seed.

A :class:`PortKind` is one kind of once-only port every container of the
fleet has. :data:`KINDS` are the ports the producers send to, the ordered
one (section 16) among them (``ordered = True`` gives its messages a key and
turns on the checker's per-key order count); :data:`DOWNSTREAM` receives what
a handler sends through the outbox, and :data:`OUTBOXED` what code outside
any handler sends through it (section 15). :func:`schedule` draws the faults
before the run, so a seed replays the same schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PortKind:
    """One kind of once-only port in every container of the fleet."""

    port: str  # the port's name, as its listener module declares it
    listener: str
    settings: dict[str, Any] = field(default_factory=dict)
    ordered: bool = False  # applied in the order sent, per key: the checker looks at the order
    sends_to: str | None = None  # the port its handler sends each message on to (the outbox)

    def key(self, n: int) -> str | None:
        """An ordered port's key of message ``n``: one of :data:`KEYS`, of one producer only.

        The producers take every other ``n``, so ``n % KEYS`` (even) keeps each key
        to one producer: the guarantee is the order of one producer's sends.
        """
        return f"k{n % KEYS:02d}" if self.ordered else None

    def body(self, n: int, queues: dict[str, str]) -> dict[str, Any]:
        if self.ordered:
            return {"key": self.key(n), "seq": n}
        if self.sends_to:
            return {"n": n, "action": "send", "to": queues[self.sends_to]}
        return {"n": n, "action": "ok"}


KINDS = (
    PortKind("Work", "tests.apps.work", {"transaction": "container"}, sends_to="Downstream"),
    PortKind("Bean", "tests.apps.bean", {"transaction": "bean"}),
    PortKind("AsyncWork", "tests.apps.asyncwork", {"transaction": "container"}),
    PortKind("BatchWork", "tests.apps.batchwork",
             {"transaction": "container", "batch_size": 10, "batch_linger": "50ms", "prefetch": 20}),
    # Spread over 3 single-active-consumer partitions: each key handled by one container at a time.
    PortKind("Ordered", "tests.apps.ordered",
             {"transaction": "container", "order_by": "body:key", "partitions": 3, "concurrency": 4},
             ordered=True),
)
KEYS = 16  # an even number: see PortKind.key
# Receives Work's outbox sends; nothing produces to it directly.
DOWNSTREAM = PortKind("Downstream", "tests.apps.downstream", {"transaction": "container"})
# Receives the outbox sends of the record's own writer, code outside any handler (Outbox.send).
OUTBOXED = PortKind("Outboxed", "tests.apps.outboxed", {"transaction": "container"})
FAULTS = ("kill", "stop", "broker", "link", "terminate", "failover")

@dataclass(frozen=True)
class Plan:
    """What one record runs: its seed, length, replication and the faults it may draw."""

    seed: int
    minutes: float
    synchronous: bool = True
    containers: int = 3
    rate: float = 24.0  # messages a second, over every port
    mean_gap: float = 30.0  # seconds between faults, on average
    faults: tuple[str, ...] = FAULTS
    once_only: bool = True
    phantoms: int = 0  # ids a producer counts as confirmed without sending them (the checker's test)
    crash_at: str | None = None  # MDB_CRASH_AT of the first container, once (the checker's test)
    kinds: tuple[PortKind, ...] = KINDS
    any_code: bool = True  # a writer outside the handlers sends to OUTBOXED through the outbox
    patience: float = 60.0  # the end: with messages still missing, how long nothing may change

    @property
    def seconds(self) -> float:
        return self.minutes * 60

    @property
    def reproduce(self) -> str:
        replication = "" if self.synchronous else " REPLICATION=async"
        gap = "" if self.mean_gap == 30.0 else f" MEAN_GAP={self.mean_gap:g}"
        return f"make record SEED={self.seed} MINUTES={self.minutes:g}{replication}{gap}"


@dataclass(frozen=True)
class Fault:
    at: float  # seconds into the run
    kind: str
    target: int  # the container or broker node it hits (0 for the others)
    seconds: float  # how long it lasts (a kill: until the restart)

    def describe(self) -> str:
        what = {"kill": f"SIGKILL container {self.target}, restart after {self.seconds:.1f}s",
                "stop": f"SIGSTOP container {self.target} for {self.seconds:.1f}s",
                "broker": f"SIGKILL broker node {self.target + 1}, back after {self.seconds:.1f}s",
                "link": f"cut the test host's links silently for {self.seconds:.1f}s",
                "terminate": "pg_terminate_backend every session of the record's database",
                "failover": "SIGKILL the primary, promote the standby, rebuild the old primary"}
        return f"{self.at:7.1f}s  {what[self.kind]}"


DURATIONS = {"kill": (0.0, 2.0), "stop": (2.0, 6.0), "broker": (3.0, 8.0), "link": (4.0, 8.0),
             "terminate": (0.0, 0.0), "failover": (0.0, 0.0)}


def schedule(plan: Plan, rng: random.Random, kinds: tuple[str, ...]) -> list[Fault]:
    """The faults, from the seed: each kind once first (in a random order, one slot each of at
    most ``plan.mean_gap``, within the first 70% of the run), then more at random.

    After the first pass the gaps are exponential around ``plan.mean_gap``; a
    quarter of all faults start with the one before (several at once). None in
    the last 10 s, so the last one has healed before the end.
    """
    end = plan.seconds - 10.0
    first = list(kinds)
    rng.shuffle(first)
    slot = min(plan.mean_gap, max(0.0, end - 3.0) * 0.7 / max(1, len(first)))
    moments = [3.0 + slot * (i + rng.uniform(0.0, 0.8)) for i in range(len(first))]
    faults: list[Fault] = []

    def add(kind: str, at: float) -> None:
        if faults and rng.random() < 0.25:
            at = faults[-1].at  # several at once
        target = rng.randrange(plan.containers if kind in ("kill", "stop") else 3)
        low, high = DURATIONS[kind]
        faults.append(Fault(round(at, 1), kind, target, round(rng.uniform(low, high), 1)))

    for kind, at in zip(first, moments, strict=True):
        if at < end:
            add(kind, at)
    at = (faults[-1].at if faults else 3.0) + rng.expovariate(1.0 / plan.mean_gap)
    while at < end and kinds:
        add(rng.choice(kinds), at)
        at = faults[-1].at + max(1.0, rng.expovariate(1.0 / plan.mean_gap))
    return faults
