"""Who holds a claim, whether they still live, and releasing the claims of the dead.

A claim names its owner channel as ``host:pid:start-time/channel-id``.  A
process killed by SIGKILL cannot hand its claims back, so every channel
that opens, and every consumer every few seconds, releases the claims,
consumers and exclusive queues of owners that are gone: a crash loses
nothing, and the messages come back at the head with ``redelivered``.
"""

from __future__ import annotations

import os
import socket

from kombu.log import get_logger

from .queue_rows import QueueStore

# The package's name, as before it was split: log lines keep their logger.
logger = get_logger("mdbcontainer.embedded")

_HOST = socket.gethostname()
_tokens: dict[int, str] = {}

#: Channels of this process that are open; their claims are live.
_open_channels: set[str] = set()


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """Return (state, start time) of `pid` from /proc, or None off Linux.

    The start time (field 22, clock ticks since boot) tells a live process
    from a later one that reused its pid.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # fields 3.. of stat(5)
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


def owner_token() -> str:
    """Identify this process in claims: ``host:pid:start-time``.

    Computed per pid so that a forked child does not inherit its parent's
    identity.
    """
    pid = os.getpid()
    token = _tokens.get(pid)
    if token is None:
        stat = _proc_stat(pid)
        token = _tokens[pid] = f"{_HOST}:{pid}:{stat[1] if stat else '?'}"
    return token


def channel_token(channel_id: str) -> str:
    """Identify one channel in claims: ``host:pid:start-time/channel-id``."""
    return f"{owner_token()}/{channel_id}"


def channel_opened(channel_id: str) -> None:
    """Mark a channel of this process live, so its claims are kept."""
    _open_channels.add(channel_id)


def channel_closed(channel_id: str) -> None:
    """Mark a channel dead: claims it failed to hand back become releasable."""
    _open_channels.discard(channel_id)


def owner_alive(token: str) -> bool:
    """Tell whether the channel named by a claim token may still be open.

    In this process, a channel closed without handing its claims back (its
    database was locked then) is dead.  Another process counts as alive
    until it exits; a zombie (SIGKILLed, not yet reaped) is dead.  Claims
    of another host are assumed alive: there is no way to check them.
    """
    process, _, channel_id = token.partition("/")
    if process == owner_token():
        return not channel_id or channel_id in _open_channels
    try:
        host, pid_text, start = process.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False  # not a token this module wrote
    if host != _HOST:
        return True
    return _process_alive(pid, start)


def _process_alive(pid: int, start: str) -> bool:
    """os.kill probes the pid; /proc's start time tells pid reuse apart."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to someone else
    stat = _proc_stat(pid)
    if stat is None:
        return True  # no /proc: trust the pid
    state, started = stat
    return state not in ("Z", "X") and (start == "?" or started == start)


class ClaimStore(QueueStore):
    """Releasing what dead owners held: claims, consumers, exclusive queues."""

    def release_dead_owners(self) -> int:
        """Unclaim messages, forget consumers, drop exclusive queues of the dead."""
        with self.lock:
            claimers = self._distinct(
                "SELECT DISTINCT claimed_by FROM broker_messages WHERE claimed_by IS NOT NULL"
            )
            owners = self._distinct(
                "SELECT DISTINCT exclusive_owner FROM broker_queues"
                " WHERE exclusive_owner IS NOT NULL"
            )
            consumers = self._distinct("SELECT DISTINCT owner FROM broker_consumers")
            released = sum(self._unclaim_all(t) for t in claimers if not owner_alive(t))
            for token in owners:
                if not owner_alive(token):
                    self._drop_exclusive(token)
            for token in consumers:
                if not owner_alive(token):
                    self.remove_consumers(token)
        if released:
            logger.info("embedded broker: released %d message(s) of dead consumers", released)
        return released

    def _distinct(self, sql: str) -> list[str]:
        return [r[0] for r in self.db.execute(sql)]

    def _unclaim_all(self, token: str) -> int:
        """Hand back every message `token` holds, flagged redelivered, in place."""
        return self.db.execute(
            "UPDATE broker_messages SET claimed_by = NULL, claim = NULL,"
            " claimed_at = NULL, redelivered = 1 WHERE claimed_by = ?",
            (token,),
        ).rowcount

    def _drop_exclusive(self, token: str) -> None:
        rows = self.db.execute("SELECT name FROM broker_queues WHERE exclusive_owner = ?", (token,))
        for name in [r[0] for r in rows]:
            self.delete_queue(name)
