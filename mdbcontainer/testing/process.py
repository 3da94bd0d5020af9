"""Test helpers users can use too: run ``mdb run`` as a real process, write settings, peek at queues.

They drive the container the way a user does (a settings file, a process, the
broker), so a test built on them proves what a user would see, crashes
included: :meth:`ContainerProcess.kill` is a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import inspect

from ..settings import Settings, load_settings
from ..state.control import Control
from ..state.store import Store, make_engine
from ..wire.connection import Broker, connection_errors
from ..wire.delivery import Delivery
from ..wire.queues import QueueSession

T = TypeVar("T")


def dump_toml(data: dict[str, Any]) -> str:
    """A small TOML writer for settings made in tests (tables of scalars and lists)."""
    lines: list[str] = []
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    for key, value in scalars.items():
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in data.items():
        if isinstance(value, dict):
            _table(lines, [key], value)
    return "\n".join(lines) + "\n"


def _table(lines: list[str], path: list[str], table: dict[str, Any]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    subtables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if scalars or not subtables:
        lines.append(f"\n[{'.'.join(_key(p) for p in path)}]")
        lines.extend(f"{_key(k)} = {_value(v)}" for k, v in scalars.items())
    for key, value in subtables.items():
        _table(lines, [*path, key], value)


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(str(value))


def write_settings(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(dump_toml(data), encoding="utf-8")
    return path


def mdb(*args: str, settings: Path | None = None, env: Mapping[str, str] | None = None,
        cwd: Path | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``mdb ARGS -c SETTINGS`` in a second process, as a user types it; exit code and output kept.

    ``env`` is added to this process's environment. The command runs in ``cwd``,
    by default the settings' directory, as :class:`ContainerProcess` does, so a
    relative path in the settings names the same file for both.
    """
    command = [sys.executable, "-m", "mdbcontainer", *args]
    if settings is not None:
        command += ["-c", str(settings)]
        cwd = cwd or Path(settings).parent
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env={**os.environ, **(env or {})})


def headers_of(message: Any) -> dict[str, Any]:
    """The application headers of a message taken with :meth:`QueueProbe.take_all` (``x-mdb-*``)."""
    return dict(message.headers or message.properties.get("application_headers") or {})


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; raise AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class ContainerProcess:
    """``mdb run`` as a child process, with its output kept in a log file."""

    def __init__(self, settings_path: Path, *, ports: list[str] | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None,
                 log_path: Path | None = None, prefix: list[str] | None = None) -> None:
        """``prefix``: a command that runs ``mdb run`` elsewhere (``["ip", "netns", "exec", NS]``).

        It must exec the command (keep its pid): the process is found in ``mdb
        ports`` by that pid.
        """
        self.prefix = list(prefix or [])
        self.settings_path = Path(settings_path)
        self.settings: Settings = load_settings(self.settings_path, environ={})
        self.ports = ports or []
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd or self.settings_path.parent
        self.log_path = log_path or self.settings_path.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None
        # The database as rows() reads it, opened on the first poll and kept while the process
        # runs (a poll every 0.2 s with an engine and a connection of its own cost more CPU than
        # the container it watched); closed when the process ends, or with this object.
        self._database: list[Control] = []  # at most one; a list the finalizer can empty
        self._tables = False  # the container's tables exist (they are never dropped under it)
        weakref.finalize(self, _dispose_all, self._database)

    def start(self, wait: bool = True, timeout: float = 30.0) -> ContainerProcess:
        self._close_database()  # a restarted process may find its database file made anew
        args = [*self.prefix, sys.executable, "-m", "mdbcontainer", "run", "-c", str(self.settings_path)]
        for port in self.ports:
            args += ["--port", port]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd)
        log.close()
        if wait:
            try:
                self.wait_started(timeout)
            except BaseException:  # ``with`` never reaches __exit__ when __enter__ raises
                self.kill()
                raise
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _close_database(self) -> None:
        _dispose_all(self._database)
        self._tables = False

    def rows(self) -> list[dict[str, Any]]:
        """This process's ports as ``mdb ports --json`` shows them.

        No rows before the container has created its tables; any other error (a wrong
        database URL, a lost server) raises instead of passing for "no ports yet".
        """
        if not self._database:
            # A relative SQLite path is resolved by load_settings; the pre-ping replaces a kept
            # connection that a test's fault (or a restarted server) ended, rather than raise.
            engine = make_engine(self.settings.container.database_url, pool_pre_ping=True)
            self._database.append(Control(Store(self.settings.container, engine=engine)))
        control = self._database[0]
        if not self._tables:
            table = control.store.tables.container
            if not inspect(control.store.engine).has_table(table.name, schema=table.schema):
                return []
            self._tables = True
        rows = control.live(control_interval=self.settings.container.control_interval)
        return [r for r in rows if r["container"].split(":")[-2] == str(self.pid)]

    def wait_started(self, timeout: float = 30.0, ports: list[str] | None = None) -> None:
        """Wait until every port (or the given ones) shows ``started``; fail early if the process died."""

        def started() -> bool:
            self._check_alive()
            rows = self.rows()
            wanted = ports or self.ports or [r["port"] for r in rows]
            states = {r["port"]: r["state"] for r in rows}
            return bool(rows) and all(states.get(p) == "started" for p in wanted)

        wait_for(started, timeout, 0.2, f"ports of {self.settings_path.name} to start")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"mdb run exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            )

    def port_state(self, port: str) -> dict[str, Any] | None:
        return next((r for r in self.rows() if r["port"] == port), None)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._close_database()
        return code

    def kill(self) -> int:
        """SIGKILL: the crash the guarantees must survive."""
        assert self.proc is not None
        with suppress(ProcessLookupError):
            self.proc.kill()
        code = self.proc.wait(30)
        self._close_database()
        return code

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        self._close_database()
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> ContainerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self.alive():
            self.dump_threads()  # a test that failed waiting for it: where it was
        if self.alive():
            self.kill()
        self._close_database()
        if exc_type is not None:  # shown by pytest with the failure
            print(f"--- output of mdb run ({self.settings_path}) ---\n{self.output()[-12000:]}")

    def dump_threads(self, settle: float = 1.0) -> None:
        """Every thread's stack into the output (``mdb run`` answers SIGUSR1 so), then a pause."""
        assert self.proc is not None
        with suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGUSR1)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(settle)  # it runs on: the wait only gives the dump time to be written


class QueueProbe:
    """Looks at queues on the settings' broker without consuming what stays.

    A queue that does not exist raises (the broker's NOT_FOUND), as does any other
    error: a misspelt name must not pass for an empty queue.

    :meth:`exists` and :meth:`count`, polled in loops, share one connection kept by
    the probe (a connection per poll cost the broker more than the poll); it closes
    with :meth:`close` or when the probe is dropped. A kept connection found dead is
    replaced once, as a fresh one would have been.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.broker = Broker(settings)
        self._kept: list[QueueSession] = []  # at most one; a list the finalizer can empty
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, self._kept)

    def exists(self, queue: str) -> bool:
        """Whether ``queue`` exists: to wait for a queue the container declares when it first sends."""
        return self._read(lambda queues: queues.exists(queue))

    def count(self, queue: str) -> int:
        """Messages ready on ``queue``."""
        return self._read(lambda queues: queues.status(queue).messages)

    def take_all(self, queue: str, limit: int = 100_000) -> list[Delivery]:
        """Consume and acknowledge every ready message of ``queue`` (for assertions at the end)."""
        with QueueSession(self.broker) as queues:
            return queues.take(queue, limit)

    def purge(self, queue: str) -> None:
        """Drop every ready message of ``queue``."""
        with QueueSession(self.broker) as queues:
            queues.purge(queue)

    def close(self) -> None:
        """Close the kept connection (a later read opens another)."""
        with self._lock:
            _close_all(self._kept)

    def _read(self, read: Callable[[QueueSession], T]) -> T:
        """``read`` on the kept session; another thread's call meanwhile takes a session of its own."""
        if not self._lock.acquire(blocking=False):
            with QueueSession(self.broker) as queues:
                return read(queues)
        try:
            if self._kept:
                try:
                    return read(self._kept[0])
                except connection_errors():  # died while kept (a heartbeat missed, a broker restart)
                    _close_all(self._kept)
            self._kept.append(QueueSession(self.broker))
            try:
                return read(self._kept[0])
            except connection_errors():
                _close_all(self._kept)
                raise
        finally:
            self._lock.release()


def _close_all(sessions: list[QueueSession]) -> None:
    while sessions:
        sessions.pop().close()


def _dispose_all(databases: list[Control]) -> None:
    while databases:
        databases.pop().store.dispose()
