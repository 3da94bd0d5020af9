"""``mdb run --processes N``: one supervisor, N container processes, as a user runs and kills them.

The supervisor is a real ``mdb run`` process started in a session of its own,
so a test can send its process group a terminal's Ctrl-C without hitting
pytest. Which container processes it started is read from its log ("container
process 2 started (pid 1234)"), and whether one still runs from /proc, so a
zombie left for init to reap does not count as alive.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from mdbcontainer.errors import MdbError, SettingsError
from mdbcontainer.runtime.supervisor import STABLE_AFTER, Supervisor, validate
from mdbcontainer.settings import load_settings
from mdbcontainer.state.control import Control
from mdbcontainer.state.store import Store
from mdbcontainer.support.logs import JsonFormatter, TextFormatter
from mdbcontainer.testing import mdb, wait_for, write_settings
from tests.conftest import ROOT, Backend, one_line_error

pytestmark = pytest.mark.slow

STARTED = re.compile(r"container process (\d+) started \(pid (\d+)\)")


def running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped has stopped running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


class Supervised:
    """``mdb run --processes N`` in its own session, its output in a log file."""

    def __init__(self, settings: Path, env: dict[str, str], *args: str) -> None:
        self.settings = settings
        self.env = {**os.environ, **env}
        self.args = args
        self.log = settings.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Supervised:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mdbcontainer", "run", "-c", str(self.settings), *self.args],
                stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def children(self) -> dict[int, int]:
        """Every container process it started: pid -> process number."""
        return {int(pid): int(n) for n, pid in STARTED.findall(self.output())}

    def latest(self, number: int) -> int:
        """The pid of process ``number``'s latest start."""
        return [pid for pid, n in self.children().items() if n == number][-1]

    def containers(self, cli: bool = False) -> dict[int, dict[str, Any]]:
        """The containers ``mdb ports --json`` shows, by pid (read in this process unless ``cli``)."""
        if cli:
            result = mdb("ports", "--json", settings=self.settings, env=self.env, cwd=ROOT)
            assert result.returncode == 0, result.stderr
            rows = json.loads(result.stdout)
        else:
            store = Store(load_settings(self.settings, environ={}).container)
            try:
                rows = Control(store).live()
            except DBAPIError:  # no tables before the first container creates them
                rows = []
            finally:
                store.dispose()
        return {int(row["container"].split(":")[-2]): row for row in rows}

    def wait_containers(self, count: int, timeout: float = 60.0) -> dict[int, dict[str, Any]]:
        """Wait until ``count`` containers show, each started by this supervisor, every port started."""

        def shown() -> dict[int, dict[str, Any]] | None:
            self.check_alive()
            rows = self.containers()
            ok = len(rows) == count and set(rows) <= set(self.children())
            return rows if ok and all(r["state"] == "started" for r in rows.values()) else None

        found: dict[int, dict[str, Any]] = wait_for(shown, timeout, 0.2, f"{count} containers")
        return found

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the supervisor exited with {self.proc.returncode}:\n"
                                 f"{self.output()[-3000:]}")

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def __enter__(self) -> Supervised:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        for pid in [self.pid, *self.children()]:  # a failed test leaves nothing running
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)
        if exc_type is not None:
            print(f"--- output of the supervisor ---\n{self.output()[-8000:]}")


class Feeder(threading.Thread):
    """Sends short messages until stopped, so the processes are under load whenever one is killed."""

    def __init__(self, backend: Backend, settings: Path, queue: str) -> None:
        super().__init__(name="feeder", daemon=True)
        self.backend, self.settings, self.queue = backend, settings, queue
        self.sent: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        with self.backend.producer(self.settings) as producer:
            while not self.done.wait(0.05):  # about 200 msg/s: less than 6 consumers handle
                for _ in range(10):
                    mid = f"f{len(self.sent)}"
                    producer.send(self.queue, {"n": len(self.sent), "action": "sleep", "seconds": 0.01},
                                  message_id=mid)
                    self.sent.append(mid)


def test_three_processes_survive_kills_under_load_and_stop_together(rabbit: Backend) -> None:
    queue = rabbit.q("SHARED")
    settings = rabbit.write(ports={"Work": {"destination": queue, "concurrency": 2, "prefetch": 5}})
    feeder = Feeder(rabbit, settings, queue)
    with Supervised(settings, rabbit.env, "--processes", "3") as supervisor:
        supervisor.wait_containers(3)
        feeder.start()
        killed: list[int] = []
        for delay in ("0.5s", "1.0s"):  # the same process killed twice: its backoff doubles
            victim = supervisor.latest(2)
            killed.append(victim)
            wait_for(lambda: supervisor.containers().get(victim, {}).get("delivered", 0) > 0,
                     timeout=30, what=f"process 2 (pid {victim}) to consume")
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: f"container process 2 (pid {victim}) killed by SIGKILL" in supervisor.output(),
                     what="the supervisor to log the death")
            assert re.search(rf"\(pid {victim}\) killed by SIGKILL after [\d.]+s; starting it again "
                             rf"in {delay}", supervisor.output()), supervisor.output()[-2000:]
            supervisor.wait_containers(3)
            assert not running(victim)
        shown = supervisor.containers(cli=True)  # as a user sees it: 3 again, the killed ones gone
        assert len(shown) == 3 and not set(shown) & set(killed)
        feeder.done.set()
        feeder.join(10)
        assert len(feeder.sent) > 100
        wait_for(lambda: len(rabbit.effects()) == len(feeder.sent), timeout=60, what="every message")

        supervisor.signal(signal.SIGTERM)
        assert supervisor.wait(40) == 0
        output = supervisor.output()
        assert len(re.findall(r"container process \d \(pid \d+\) exited with status 0", output)) == 3
        assert "second signal" not in output
        assert [pid for pid in supervisor.children() if running(pid)] == []
    assert len(supervisor.children()) == 5, "3 processes and 2 restarts"
    assert set(rabbit.effects()) == set(feeder.sent)
    assert set(rabbit.effects().values()) == {1}, "every message applied once"
    probe = rabbit.probe(settings)
    assert probe.count(queue) == 0
    assert probe.count(rabbit.q("DLQ")) == 0


@pytest.fixture
def embedded(tmp_path: Path) -> Any:
    b = Backend("embedded", tmp_path)
    yield b
    b.close()


def test_a_supervisor_killed_with_sigkill_leaves_no_container_running(embedded: Backend) -> None:
    queue = embedded.q("ORPHANS")
    settings = embedded.write(ports={"Work": {"destination": queue}})
    with Supervised(settings, embedded.env, "--processes", "2") as supervisor:
        supervisor.wait_containers(2)
        with embedded.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "sleep", "seconds": 2}, message_id="in-flight")
        wait_for(embedded.attempts, what="the slow handler to start")
        children = list(supervisor.children())
        supervisor.signal(signal.SIGKILL)
        wait_for(lambda: not any(running(pid) for pid in children), timeout=15,
                 what="the orphaned containers to stop by themselves")
        output = supervisor.output()
        assert output.count("signal SIGTERM: stopping") == 2, "each stopped gracefully, once"
        assert "second signal" not in output
    assert embedded.effects() == {"in-flight": 1}, "the delivery in flight finished before the stop"


def two_free_ports() -> int:
    """A port P such that P and P + 1 are free now."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return int(port)
    raise AssertionError("no two free ports in a row")


def test_ctrl_c_reaches_the_supervisor_which_stops_each_process_once(embedded: Backend) -> None:
    queue = embedded.q("CTRLC")
    metrics = two_free_ports()
    settings = embedded.write(ports={"Work": {"destination": queue, "concurrency": 2}}, processes=2,
                              metrics_port=metrics, metrics_host="127.0.0.1")
    ids = [f"c{i}" for i in range(20)]
    with Supervised(settings, embedded.env) as supervisor:  # processes = 2 from the settings
        supervisor.wait_containers(2)
        for port in (metrics, metrics + 1):  # process N serves on metrics_port + N - 1
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
                assert answer.status == 200
        with embedded.producer(settings) as producer:
            for n, mid in enumerate(ids):
                producer.send(queue, {"n": n}, message_id=mid)
        wait_for(lambda: len(embedded.effects()) == len(ids), what="every message")
        os.killpg(supervisor.pid, signal.SIGINT)  # what a terminal does: the foreground group
        assert supervisor.wait(30) == 0
        output = supervisor.output()
        assert "SIGINT: stopping 2 container process(es) gracefully" in output
        assert output.count("signal SIGTERM: stopping") == 2, "one signal per process"
        assert "signal SIGINT" not in output, "no child saw Ctrl-C"
        assert [pid for pid in supervisor.children() if running(pid)] == []
    assert set(embedded.effects().values()) == {1}


def settings_file(tmp_path: Path, ports: dict[str, Any], listener: str = "work",
                  **container: Any) -> Path:
    return write_settings(tmp_path / "settings.toml", {
        "container": {"broker_url": f"embedded://{tmp_path / 'broker.db'}",
                      "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
                      "listeners": [f"tests.apps.{listener}"], **container},
        "ports": ports,
    })


def test_a_settings_error_exits_2_in_one_line_before_any_process_starts(tmp_path: Path) -> None:
    durable = {"topic": "t", "client_id": "c", "subscription": "s", "durable": True}
    settings = settings_file(tmp_path, {"Jms": durable}, listener="jms", processes=2)
    for command in ("run", "check"):
        result = mdb(command, settings=settings, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)
        line = one_line_error(result, 2)
        assert "ports.Jms: a durable subscription has one active subscriber (JMS)" in line
    assert not (tmp_path / "db.sqlite").exists(), "no container process started"


def test_a_bad_metadata_setting_exits_2_in_one_line_not_a_restart_loop(tmp_path: Path) -> None:
    """The supervisor builds what a container process builds: container.metadata included."""
    settings = settings_file(tmp_path, {"Work": {"destination": "W"}}, processes=2,
                             metadata="tests.apps.work:no_such_metadata")
    result = mdb("run", settings=settings, env={"PYTHONPATH": str(ROOT)}, cwd=ROOT, timeout=45)
    line = one_line_error(result, 2)
    assert "container.metadata = 'tests.apps.work:no_such_metadata'" in line, line
    assert "has no attribute 'no_such_metadata'" in line, line


REFUSED_IN_CHILD = """
import sys

from mdbcontainer import Message, message_driven

# Imports in the supervisor, fails in a container process: an error only the child finds.
if "--supervisor" in sys.argv:
    raise RuntimeError("the licence file is missing on this host")


@message_driven("Work", destination="W")
def work(message: Message) -> None: ...
"""


def test_a_process_that_exits_2_before_it_started_stops_the_supervisor_with_its_line(
        tmp_path: Path) -> None:
    (tmp_path / "child_refuses.py").write_text(REFUSED_IN_CHILD)
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}", "listeners": ["child_refuses"]}})
    started = time.monotonic()
    result = mdb("run", "--processes", "2", settings=settings, cwd=tmp_path, timeout=45)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 30, "stopped at the first refusal, no restart loop"
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mdb: error:")]
    assert len(errors) == 1, result.stderr  # one line, not one per process
    assert "listener module 'child_refuses' failed to import: RuntimeError: the licence file is " \
           "missing on this host" in errors[0], errors[0]
    assert result.stderr.rstrip().endswith(errors[0]), "the line is the last word"
    assert "starting it again" not in result.stderr, result.stderr


@pytest.mark.parametrize(("container", "ports", "culprit"), [
    ({"metrics_port": 65535}, None, "container.metrics_port: 65535 is too high for 3 processes"),
    ({}, ["Nope"], "--port 'Nope': no such port"),
])
def test_the_supervisor_refuses_what_a_process_would(
        tmp_path: Path, container: dict[str, Any], ports: list[str] | None, culprit: str) -> None:
    settings = load_settings(settings_file(tmp_path, {"Work": {"destination": "W"}}, **container),
                             environ={})
    with pytest.raises(MdbError, match=re.escape(culprit)):
        validate(settings, ports, 3)


def test_processes_must_be_at_least_1(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"container\.processes: .*greater than or equal to 1"):
        load_settings(settings_file(tmp_path, {"Work": {"destination": "W"}}, processes=0), environ={})


def test_a_process_whose_supervisor_is_gone_stops_by_itself(embedded: Backend) -> None:
    """The portable fallback: the parent pid it was given is not its parent, so it stops."""
    settings = embedded.write(ports={"Work": {"destination": embedded.q("GONE")}})
    result = mdb("run", "--supervisor", "1", "--process-index", "1", settings=settings, env=embedded.env,
                 cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "[process 1]" in result.stderr
    assert "supervisor (pid 1) is gone: stopping this container gracefully" in result.stderr


def test_restart_delays_double_up_to_30s_and_start_over_after_a_stable_run(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = load_settings(settings_file(tmp_path, {"Work": {"destination": "W"}}), environ={})
    supervisor = Supervisor(settings, 2)
    supervisor.store.dispose()  # never run: no process starts, no row to forget
    slot = supervisor.slots[1]
    with caplog.at_level(logging.WARNING, logger="mdbcontainer.supervisor"):
        for lived in (1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0, STABLE_AFTER, 1.0):
            supervisor._schedule(slot, "killed by SIGKILL", 4242, lived)
    delays = [float(m) for m in re.findall(r"starting it again in ([\d.]+)s", caplog.text)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 0.5, 1.0]
    assert "container process 2 (pid 4242) killed by SIGKILL after 1.0s" in caplog.text


def test_each_log_line_names_its_process_in_text_and_json() -> None:
    record = logging.LogRecord("mdbcontainer.port", logging.INFO, __file__, 1, "port %s started",
                               ("Work",), None)
    assert "[process 3] mdbcontainer.port [MainThread] port Work started" in TextFormatter(3).format(record)
    assert json.loads(JsonFormatter(3).format(record))["process"] == 3
    assert "process" not in json.loads(JsonFormatter().format(record)), "one process: no label"
