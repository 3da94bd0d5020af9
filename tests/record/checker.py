"""The record's checker: what the producers sent against what the handlers applied.

In the words of the RabbitMQ Jepsen checker, for every port:

- **lost**: confirmed to its producer, never applied;
- **duplicated**: applied more than once;
- **unexpected**: applied, never sent (to that port);
- **recovered**: applied once although a fault hit it: its send was never
  confirmed (the producer saw the broker fail and sent it again, or gave
  up), or its handler was called more than once (a kill, a broker or
  database fault took it back);
- **order violations** (ordered ports): a message applied after a later
  message of its key.

The inputs are plain data (the producers' log, the applied rows in the order
they committed, the handlers' attempts), so the checker is tested on its own
and the same function reads a record's folder afterwards.

Outbox sends from code outside any handler (section 15) are checked at the
port downstream of the relay: their producer is a transaction, and
:func:`committed` says which of its sends the database holds, so that a
send whose transaction committed must be applied even when its writer never
heard the commit's answer, and a send of a transaction rolled back must not.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

SAMPLE = 5  # ids named per count in the report


@dataclass
class Sent:
    """One message as its producer saw it."""

    port: str
    message_id: str
    attempts: int = 0  # publishes tried (a retry after a broker fault is one more)
    confirmed: bool = False
    key: str | None = None  # ordered ports: the key and the message's place among its key's
    seq: int = 0


@dataclass
class PortCounts:
    port: str
    sent: int = 0
    confirmed: int = 0
    applied: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)

    COUNTS = ("lost", "duplicated", "unexpected", "recovered", "order_violations")

    @property
    def broken(self) -> bool:
        """Anything but recovered is a breach of once and only once."""
        return bool(self.lost or self.duplicated or self.unexpected or self.order_violations)

    def line(self) -> str:
        counts = " ".join(f"{name}={len(getattr(self, name))}" for name in self.COUNTS)
        named = "; ".join(f"{name}: {', '.join(sorted(ids)[:SAMPLE])}" for name in self.COUNTS
                          if name != "recovered" and (ids := getattr(self, name)))
        return (f"{self.port}: sent={self.sent} confirmed={self.confirmed} applied={self.applied} {counts}"
                + (f" ({named})" if named else ""))


@dataclass
class Report:
    ports: list[PortCounts]

    def total(self, name: str) -> int:
        return sum(len(getattr(p, name)) for p in self.ports)

    @property
    def broken(self) -> bool:
        return any(p.broken for p in self.ports)

    def lines(self) -> list[str]:
        totals = " ".join(f"{name}={self.total(name)}" for name in PortCounts.COUNTS)
        return [*(p.line() for p in self.ports),
                f"total: sent={sum(p.sent for p in self.ports)} confirmed={sum(p.confirmed for p in self.ports)} "
                f"applied={sum(p.applied for p in self.ports)} {totals}"]


def committed(sent: Iterable[Sent], rows: Iterable[str]) -> list[Sent]:
    """``sent`` (an outbox writer's sends) with every one whose business row is in ``rows`` confirmed.

    The writer counts a send confirmed when its COMMIT returned; one whose
    COMMIT lost its connection and that it gave up on may have committed all
    the same, and then the relay owes it: its row says so. A send confirmed
    whose row is gone (an asynchronous standby promoted before it had the
    commit) stays confirmed: the writer was told it committed, so it is lost.
    """
    there = set(rows)
    return [Sent(m.port, m.message_id, m.attempts, m.confirmed or m.message_id in there, m.key, m.seq)
            for m in sent]


def check(sent: Iterable[Sent], applied: Iterable[tuple[str, str]],
          attempts: Counter[tuple[str, str]] | None = None,
          ordered: Iterable[str] = (), ports: Iterable[str] = ()) -> Report:
    """Compare ``sent`` with ``applied`` ((port, message id) in commit order) port by port.

    ``attempts`` counts the handler calls per (port, message id); ``ordered``
    names the ports whose keys must be applied in their order; ``ports`` the
    ports to report even when nothing was sent to or applied on them.
    """
    attempts = attempts or Counter()
    by_port: dict[str, dict[str, Sent]] = defaultdict(dict)
    for message in sent:
        by_port[message.port][message.message_id] = message
    rows: dict[str, list[str]] = defaultdict(list)
    for port, message_id in applied:
        rows[port].append(message_id)
    ordered = set(ordered)
    names = sorted({*ports, *by_port, *rows})
    return Report([_port(name, by_port[name], rows[name], attempts, name in ordered) for name in names])


def _port(name: str, sent: dict[str, Sent], rows: list[str], attempts: Counter[tuple[str, str]],
          ordered: bool) -> PortCounts:
    times = Counter(rows)
    counts = PortCounts(name, sent=len(sent), confirmed=sum(m.confirmed for m in sent.values()),
                        applied=len(times))
    counts.lost = [m for m, s in sent.items() if s.confirmed and m not in times]
    counts.duplicated = [m for m, n in times.items() if n > 1]
    counts.unexpected = [m for m in times if m not in sent]
    counts.recovered = [m for m, n in times.items() if n == 1 and m in sent
                        and (not sent[m].confirmed or sent[m].attempts > 1 or attempts[(name, m)] > 1)]
    if ordered:
        counts.order_violations = _out_of_order(sent, rows)
    return counts


def _out_of_order(sent: dict[str, Sent], rows: list[str]) -> list[str]:
    """Messages applied after a message of their key that was sent later."""
    highest: dict[str, int] = {}
    late = []
    for message_id in dict.fromkeys(rows):  # each message's first application
        message = sent.get(message_id)
        if message is None or message.key is None:
            continue
        if message.seq < highest.get(message.key, -1):
            late.append(message_id)
        highest[message.key] = max(message.seq, highest.get(message.key, -1))
    return late
