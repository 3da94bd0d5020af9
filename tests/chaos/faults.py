"""Infrastructure faults aimed at one container process, on the machine's real services.

Other tests run beside these ones against the same RabbitMQ and PostgreSQL,
so the faults are targeted: the container's own broker connections are
closed (found through its local TCP ports), and the container logs in to
PostgreSQL with a role of its own that can be refused while every other user
keeps working. Only :func:`restart_broker_app` stops the whole broker; it
holds ``/tmp/mdb-disruptive.lock`` meanwhile, the lock every run that stops a
service takes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from sqlalchemy import create_engine, text

from tests.conftest import rabbitmqctl

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
AMQP_PORT = 5672
LOCK = Path("/tmp/mdb-disruptive.lock")


def broker_ports_of(pid: int) -> set[int]:
    """The local TCP ports of ``pid``'s connections to RabbitMQ (from ``ss -tnp``)."""
    out = subprocess.run(["ss", "-tnpH", f"dport = :{AMQP_PORT}"], capture_output=True,
                         text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = line.split()[3]
            ports.add(int(local.rsplit(":", 1)[1]))
    return ports


def close_broker_connections(pid: int, reason: str = "chaos") -> int:
    """Close every RabbitMQ connection of process ``pid`` from the broker's side; return how many.

    py-amqp sets no connection name, so the connections are matched by their
    peer port. They are closed in one ``rabbitmqctl eval`` calling
    ``rabbit_networking:close_connection/2`` (what ``rabbitmqctl
    close_connection`` calls for one), so that all of them go within
    milliseconds, as they would when the broker drops its clients; one
    ``close_connection`` per connection would take half a second each.
    """
    ports = sorted(broker_ports_of(pid))
    expr = (
        f"Ports = [{','.join(map(str, ports))}], "
        "Conns = [proplists:get_value(pid, I)"
        " || I <- rabbit_networking:connection_info_all([pid, peer_port]),"
        " lists:member(proplists:get_value(peer_port, I), Ports)], "
        f"[rabbit_networking:close_connection(C, {json.dumps(reason)}) || C <- Conns], length(Conns)."
    )
    return int(rabbitmqctl("eval", expr).strip() or 0)


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class Forwarder:
    """A TCP forwarder (socat) to a local endpoint: stopped, the endpoint is out of reach.

    For a transport without connections of its own to close (SQS: each call is
    an HTTP request) and a server that cannot be restarted (moto keeps its
    queues in memory): the container reaches the endpoint through this, and
    stopping it kills socat's whole process group, so the connections it
    forwards end too, as a network that goes away ends them.
    """

    def __init__(self, to: int) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.to = to
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["socat", f"TCP-LISTEN:{self.port},bind=127.0.0.1,fork,reuseaddr", f"TCP:127.0.0.1:{self.to}"],
            start_new_session=True)
        deadline = time.monotonic() + 10
        while not accepts(self.port):
            if time.monotonic() > deadline:
                raise AssertionError(f"socat did not listen on {self.port} within 10 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            self.process = None


@contextmanager
def forwarded(url: str) -> Iterator[Forwarder]:
    """A started :class:`Forwarder` to ``url``'s port (``http://127.0.0.1:PORT``), stopped at the end."""
    forwarder = Forwarder(int(urlsplit(url).port or 80))
    forwarder.start()
    try:
        yield forwarder
    finally:
        forwarder.stop()


@contextmanager
def disruptive_lock(shared: bool = False) -> Iterator[None]:
    """Hold the machine-wide lock of runs that stop a service (waits for another holder).

    ``shared``: no service may stop meanwhile, but other shared holders may run
    (a run whose checks an outage it did not cause would falsify). When this
    process or a parent already holds the lock (``flock
    /tmp/mdb-disruptive.lock make chaos``), taking it again would wait for
    ever: their hold covers this one.
    """
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    with LOCK.open("a") as handle:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if _held_by_an_ancestor(os.fstat(handle.fileno()).st_ino):
                yield
                return
            print(f"waiting for {LOCK} (another run is stopping a service)", flush=True)
            fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _held_by_an_ancestor(inode: int) -> bool:
    """True when a flock on ``inode`` belongs to this process or one of its ancestors (/proc/locks)."""
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
            holders.add(int(fields[4]))
    pid = os.getpid()
    while pid > 1:
        if pid in holders:
            return True
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def restart_broker_app(pause: float) -> float:
    """``rabbitmqctl stop_app``, wait ``pause`` s, ``start_app``; return seconds the broker was down.

    The start runs in a ``finally``, so RabbitMQ is running again whatever
    happened, and this returns only once the app runs and port 5672 accepts.
    """
    with disruptive_lock():
        began = time.monotonic()
        try:
            rabbitmqctl("stop_app")
            time.sleep(pause)
        finally:
            rabbitmqctl("start_app")
            rabbitmqctl("await_startup")
            deadline = time.monotonic() + 60
            while not accepts(AMQP_PORT) and time.monotonic() < deadline:
                time.sleep(0.2)
        return time.monotonic() - began


class DatabaseRole:
    """A PostgreSQL login role for one container, so that only that container can be refused."""

    def __init__(self, name: str | None = None, admin_url: str = ADMIN_URL) -> None:
        self.name = name or f"mdb_chaos_{uuid.uuid4().hex[:8]}"
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.name}@127.0.0.1:5432/test"

    def _do(self, sql: str) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(sql))

    def create(self) -> DatabaseRole:
        self._do(f"CREATE ROLE {self.name} LOGIN SUPERUSER")
        return self

    def refuse(self) -> int:
        """Block new logins, then cut the role's sessions; return how many were cut."""
        self._do(f"ALTER ROLE {self.name} NOLOGIN")
        return self._terminate()

    def _terminate(self) -> int:
        with self.admin.connect() as conn:
            rows = conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :name"
            ), {"name": self.name}).all()
        return len(rows)

    def allow(self) -> None:
        self._do(f"ALTER ROLE {self.name} LOGIN")

    @contextmanager
    def refused(self) -> Iterator[int]:
        """PostgreSQL refuses the role inside the block (yields the sessions cut); logins come back after."""
        try:
            yield self.refuse()
        finally:
            self.allow()

    def outage(self, seconds: float) -> int:
        """Refuse the role for ``seconds``; return the sessions cut."""
        with self.refused() as cut:
            time.sleep(seconds)
        return cut

    def drop(self) -> None:
        """Cut the role's sessions, give what it owns to postgres, drop it."""
        try:
            self._terminate()
            self._do(f"REASSIGN OWNED BY {self.name} TO postgres")
            self._do(f"DROP ROLE IF EXISTS {self.name}")
        finally:
            self.admin.dispose()
