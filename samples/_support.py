"""What every sample's ``run.py`` shares: a scratch directory, the ``mdb`` command, containers.

A sample drives the container the way a person does, from a second terminal:
``mdb run`` is a child process, every other step is an ``mdb`` command whose
output is printed as a transcript. Each run gets a scratch directory of its
own (the embedded broker and database live in its ``.mdb/``); set
``MDB_CONTAINER__BROKER_URL`` and ``MDB_CONTAINER__DATABASE_URL`` to run the
same walk-through on RabbitMQ and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mdbcontainer.settings import Settings, load_settings
from mdbcontainer.state.control import Control
from mdbcontainer.state.store import Store
from mdbcontainer.testing import wait_for


class SampleFailed(Exception):
    """The walk-through did not show what it promises."""


class Walk:
    """One walk-through: its settings, its scratch directory, its container processes."""

    def __init__(self, here: Path, keep: bool = False) -> None:
        self.here = here
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mdb-{here.name}-"))
        # Relative paths in a settings file (.mdb/broker.db) resolve against its folder: the
        # walk-through runs a copy of the sample, so its broker and database start empty.
        shutil.copytree(here, self.tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".mdb", "__pycache__", "*.log"))
        self.settings_path = self.tmp / "settings.toml"
        self.keep = keep
        self._procs: list[subprocess.Popen[bytes]] = []
        self._store: Store | None = None
        os.chdir(self.tmp)

    @property
    def settings(self) -> Settings:
        return load_settings(self.settings_path)

    # -- telling -----------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"\n== {text}", flush=True)

    def note(self, text: str) -> None:
        print(f"   {text}", flush=True)

    # -- the mdb command ---------------------------------------------------

    def mdb(self, *args: str, show: bool = True, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``mdb ARGS -c settings.toml`` and print it as a person would see it."""
        command = [sys.executable, "-m", "mdbcontainer", *args, "-c", str(self.settings_path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "COLUMNS": "160", **(env or {})})
        if show:
            print(f"$ mdb {shlex.join(args)} -c settings.toml", flush=True)
            for stream in (result.stdout, result.stderr):
                if stream.strip():
                    print(stream.rstrip(), flush=True)
        if check and result.returncode != 0:
            raise SampleFailed(f"mdb {shlex.join(args)} exited {result.returncode}: "
                               f"{result.stderr.strip()}")
        return result

    def ports(self) -> dict[str, dict[str, Any]]:
        """What ``mdb ports --json`` prints, by port name (one container at a time runs here).

        Read in this process, not through an ``mdb`` command: a walk-through
        polls it while it waits, and each command would pay a Python start-up
        (a second or more on a busy machine). The ``mdb ports`` the transcript
        shows stay commands.
        """
        if self._store is None:
            self._store = Store(self.settings.container)
            self._store.create_tables()
        rows = Control(self._store).live(control_interval=self.settings.container.control_interval)
        return {row["port"]: json.loads(json.dumps(row, default=str)) for row in rows}

    # -- containers --------------------------------------------------------

    def start(self, env: dict[str, str] | None = None, log_name: str = "container.log") -> Container:
        """``mdb run`` in the background; its log goes to a file in the scratch directory."""
        self.note(f"$ mdb run -c settings.toml   (log: {self.tmp / log_name})")
        log = (self.tmp / log_name).open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "mdbcontainer", "run", "-c", str(self.settings_path)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )
        log.close()
        self._procs.append(proc)
        return Container(self, proc, self.tmp / log_name)

    def wait_for(self, predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        try:
            return wait_for(predicate, timeout, 0.2, what)
        except AssertionError as exc:
            raise SampleFailed(str(exc)) from None

    def expect(self, condition: bool, what: str) -> None:
        if not condition:
            raise SampleFailed(what)
        self.note(f"ok: {what}")

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        if self._store is not None:
            self._store.dispose()
        os.chdir(self.here)
        if not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)


class Container:
    """A running ``mdb run`` of a walk-through."""

    def __init__(self, walk: Walk, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.walk = walk
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def lines(self, text: str) -> list[str]:
        """The log lines that contain ``text``, without their time stamp and thread."""
        return [line.split("] ", 1)[-1] for line in self.output().splitlines() if text in line]

    def wait_started(self, *ports: str) -> None:
        def started() -> bool:
            if self.proc.poll() is not None:
                raise SampleFailed(f"mdb run exited {self.proc.returncode}:\n{self.output()[-2000:]}")
            rows = self.walk.ports()
            return bool(rows) and all(rows.get(p, {}).get("state") == "started" for p in ports)

        self.walk.wait_for(started, f"ports {', '.join(ports)} to start")

    def terminate(self) -> int:
        """SIGTERM: stop consuming, finish in-flight deliveries, exit 0."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its threads' stacks into its log
            time.sleep(1.0)
            raise SampleFailed(f"mdb run did not stop within 60 s of SIGTERM (its stacks are in "
                               f"{self.log.name}):\n{self.output()[-6000:]}") from None


def main(walk_through: Callable[[Walk], None], here: str) -> None:
    """Run a walk-through; exit 0 when it showed what it promises, 1 otherwise."""
    keep = "--keep" in sys.argv
    walk = Walk(Path(here).resolve().parent, keep=keep)
    try:
        walk_through(walk)
    except SampleFailed as exc:
        print(f"\nsample failed: {exc}", file=sys.stderr)
        for log in sorted(walk.tmp.glob("*.log")):
            print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        sys.exit(1)
    finally:
        walk.close()
    print("\nsample ok", flush=True)
