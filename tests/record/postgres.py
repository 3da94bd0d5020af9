"""A PostgreSQL primary with a streaming standby, on spare ports, beside the machine's own cluster.

Two data folders under a fresh folder of /tmp owned by the postgres user,
each a server of its own (``initdb``, then ``pg_ctl`` with its port on the
command line), never the machine's cluster on 5432. The first is made by
``initdb`` and is the primary; the second is ``pg_basebackup -c fast -R``
of it, a hot standby streaming from it. ``synchronous = True`` names the
standby in ``synchronous_standby_names``: a commit returns once the standby
has it on disk (``synchronous_commit = on``), so a failover loses nothing
acknowledged; asynchronous, a commit returns once it is on the primary's disk
and a failover loses what the standby had not received yet.

:meth:`Replicated.fail_over` is the fault: every process of the primary
SIGKILLed (a machine gone, not a shutdown), the standby promoted, and the old
primary's folder rebuilt from the new primary as its standby. The
:attr:`Replicated.url` names both servers with ``target_session_attrs=read-write``,
so a client connects to whichever is the primary now.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from tests.chaos.cluster import _free_ports

USER = "postgres"


def _server_binaries() -> Path:
    """The newest PostgreSQL server's binaries of Debian's layout (/usr/lib/postgresql/N/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
                   if p.parts[-3].isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


BIN = _server_binaries()
# Both servers read the same settings (pg_basebackup copies them along); the port comes on the
# command line. fsync off: the faults here kill processes, never the machine, so the page cache
# survives them, and the shared disk is spared.
CONF = """\
listen_addresses = '127.0.0.1'
unix_socket_directories = '{sockets}'
max_connections = 300
wal_level = replica
max_wal_senders = 8
wal_keep_size = '256MB'
hot_standby = on
fsync = off
full_page_writes = off
synchronous_commit = on
synchronous_standby_names = '{standby}'
shared_buffers = '32MB'
log_min_messages = warning
"""
HBA = """\
local all all trust
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
"""


def available() -> str | None:
    """Why a replicated pair cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "a PostgreSQL pair needs root (to run the servers as the postgres user)"
    for tool in ("initdb", "pg_ctl", "pg_basebackup"):
        if not (BIN / tool).exists():
            return f"a PostgreSQL pair needs {BIN / tool}"
    return None


def as_postgres(*command: str, timeout: float = 120.0) -> str:
    done = subprocess.run(["runuser", "-u", USER, "--", *command], capture_output=True, text=True,
                          timeout=timeout, cwd="/tmp")
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {(done.stderr or done.stdout).strip()[-800:]}")
    return done.stdout


@dataclass
class Server:
    """One data folder and its port."""

    name: str
    port: int
    folder: Path

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def pids(self) -> list[int]:
        """The postmaster and every process it started."""
        with suppress(OSError, ValueError, IndexError):
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
            children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(postmaster)],
                                      capture_output=True, text=True).stdout.split()
            return [postmaster, *map(int, children)]
        return []

    def start(self) -> None:
        as_postgres(str(BIN / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                    "-l", str(self.folder / "log"), "-o", f"-p {self.port}")

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends at once: the server is gone, as with its machine."""
        for pid in self.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in self.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        (self.data / "postmaster.pid").unlink(missing_ok=True)

    def sql(self, statement: str) -> list[tuple[object, ...]]:
        # Never waiting for a standby: CREATE DATABASE runs before there is one.
        engine = create_engine(self.url(), isolation_level="AUTOCOMMIT",
                               connect_args={"options": "-c synchronous_commit=local"})
        try:
            with engine.connect() as conn:
                result = conn.execute(text(statement))
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            engine.dispose()


@dataclass
class Replicated:
    """A primary and its streaming standby; :meth:`fail_over` swaps them the hard way."""

    synchronous: bool = True
    database: str = "record"
    with_standby: bool = True  # False: the primary alone (synchronous: its commits wait for ever)
    servers: list[Server] = field(default_factory=list)
    root: Path | None = None
    failovers: int = 0

    def start(self) -> Replicated:
        self.root = Path(tempfile.mkdtemp(prefix="mdb-pg-"))
        self.root.chmod(0o755)
        ports = _free_ports(2)
        self.servers = [Server(f"pg{i + 1}", ports[i], self.root / f"pg{i + 1}") for i in range(2)]
        for server in self.servers:
            server.folder.mkdir()
        subprocess.run(["chown", "-R", f"{USER}:{USER}", str(self.root)], check=True)
        first = self.servers[0]
        as_postgres(str(BIN / "initdb"), "-D", str(first.data), "-U", USER, "-A", "trust", "--no-sync")
        (first.data / "postgresql.conf").write_text(CONF.format(
            sockets=self.root, standby="*" if self.synchronous else ""))
        (first.data / "pg_hba.conf").write_text(HBA)
        first.start()
        first.sql(f"CREATE DATABASE {self.database}")
        if self.with_standby:
            self._follow(self.servers[1], first)
        return self

    def _follow(self, standby: Server, primary: Server) -> None:
        """Make ``standby`` a fresh copy of ``primary`` streaming from it, and start it."""
        shutil.rmtree(standby.data, ignore_errors=True)
        as_postgres(str(BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", USER,
                    "-D", str(standby.data), "-R", "-c", "fast", "-X", "stream", "--no-sync")
        standby.start()
        deadline = time.monotonic() + 60
        while not primary.sql("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{standby.name} does not stream from {primary.name}")
            time.sleep(0.2)

    @property
    def primary(self) -> Server:
        return self.servers[0]

    @property
    def standby(self) -> Server:
        return self.servers[1]

    @property
    def url(self) -> str:
        """Both servers, libpq's multi-host form: a connection goes to the one that takes writes."""
        hosts = "&".join(f"host=127.0.0.1:{server.port}" for server in self.servers)
        return f"postgresql+psycopg://postgres@/{self.database}?{hosts}&target_session_attrs=read-write"

    def engine(self) -> Engine:
        return create_engine(self.url, pool_pre_ping=True)

    def fail_over(self, pause: float = 1.0) -> float:
        """Kill the primary, promote the standby, rebuild the old primary as the new standby.

        Returns the seconds from the kill to the promoted server taking writes.
        """
        old, new = self.primary, self.standby
        if not self.streaming():  # an earlier rebuild failed: killing the primary now would kill both
            self.heal()
            if not self.streaming():
                raise RuntimeError(f"no standby streaming from {old.name}: no failover this time")
        began = time.monotonic()
        old.kill()
        time.sleep(pause)  # a failover manager's detection time
        as_postgres(str(BIN / "pg_ctl"), "promote", "-w", "-t", "60", "-D", str(new.data))
        while new.sql("SELECT pg_is_in_recovery()") != [(False,)]:
            time.sleep(0.1)
        took = time.monotonic() - began
        self.servers = [new, old]
        self.failovers += 1
        self._rebuild(old, new)
        return took

    def streaming(self) -> bool:
        """A standby streams from the primary (a failover now has somewhere to go)."""
        try:
            return bool(self.primary.sql("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'"))
        except Exception:
            return False

    def _rebuild(self, standby: Server, primary: Server, tries: int = 3) -> None:
        """:meth:`_follow`, again after a pause if it fails: a killed server's last backends may
        hold its shared memory a moment longer, and its new start is refused meanwhile."""
        for attempt in range(1, tries + 1):
            try:
                standby.kill()
                self._follow(standby, primary)
                return
            except Exception:
                if attempt == tries:
                    raise
                time.sleep(2.0 * attempt)

    def heal(self) -> None:
        """The end of a run: a standby streams again if a rebuild had failed."""
        if self.with_standby and not self.streaming():
            self._rebuild(self.standby, self.primary)

    def terminate_backends(self, database: str | None = None) -> int:
        """``pg_terminate_backend`` of every client session of the primary's ``database``."""
        rows = self.primary.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{database or self.database}' AND pid <> pg_backend_pid()")
        return len(rows)

    def sessions(self, where: str) -> list[int]:
        """The pids of the primary's client sessions of the record's database matching ``where``."""
        return [int(str(row[0])) for row in self.primary.sql(
            f"SELECT pid FROM pg_stat_activity WHERE datname = '{self.database}' "
            f"AND pid <> pg_backend_pid() AND ({where})")]

    def remove(self) -> None:
        for server in self.servers:
            server.kill()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with suppress(OSError):
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    return False
