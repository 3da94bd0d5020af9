"""Fixtures: every behaviour test runs on the embedded broker and on RabbitMQ + PostgreSQL;
the ones that hold on every transport (fixture ``transport``) on Amazon SQS too (moto's server).

Queue names and PostgreSQL schemas are unique per test (uuid4), so tests never
see each other's messages. With MDB_REQUIRE_SERVICES=1 (CI), a service that
cannot be reached fails the test instead of skipping it.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import subprocess
import sys
import uuid
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import MetaData, create_engine, text

from mdbcontainer.sending.producer import Producer
from mdbcontainer.settings import QueueSettings, Settings, load_settings
from mdbcontainer.testing import ContainerProcess, QueueProbe, write_settings
from mdbcontainer.wire.delays import wait_queues

ROOT = Path(__file__).resolve().parent.parent
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

# What an ``mdb`` child process needs to import the test listeners (tests.apps), wherever it runs.
CHILD_ENV = {"PYTHONPATH": str(ROOT)}

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def require(port: int, name: str) -> None:
    if reachable(port):
        return
    message = f"{name} is not reachable on 127.0.0.1:{port}"
    if os.environ.get("MDB_REQUIRE_SERVICES"):
        pytest.fail(message + " (MDB_REQUIRE_SERVICES=1: a missing service is a failure)")
    pytest.skip(message)


class Backend:
    """One test's broker and database, settings writer and probes."""

    def __init__(self, kind: str, tmp: Path, database: str | None = None) -> None:
        """``kind``: the transport (embedded, rabbitmq, sqs); ``database``: sqlite or postgres
        (by default PostgreSQL with RabbitMQ, SQLite otherwise), in a schema of its own on PostgreSQL."""
        self.kind = kind
        self.tmp = tmp
        self.tag = uuid.uuid4().hex[:8]
        self.log = tmp / "attempts.log"
        self.schema: str | None = None
        self.database = database or ("postgres" if kind == "rabbitmq" else "sqlite")
        if kind == "rabbitmq":
            require(5672, "RabbitMQ")
            self.broker_url = RABBITMQ_URL
        elif kind == "sqs":
            self.broker_url = "sqs://"
        else:
            self.broker_url = f"embedded://{tmp / 'broker.db'}"
        if self.database == "postgres":
            require(5432, "PostgreSQL")
            self.database_url = POSTGRES_URL
            self.schema = f"t_{self.tag}"
        else:
            self.database_url = f"sqlite:///{tmp / 'container.db'}"
        self.queues: set[str] = set()
        # One probe per settings file (and content), so that a wait_for polling
        # ``backend.probe(path).count(q)`` reuses the probe's broker connection.
        self._probes: dict[tuple[Path, str], QueueProbe] = {}
        self._sqs: Any = None
        self.engine = create_engine(self.database_url)
        self._create_business_tables()

    def _create_business_tables(self) -> None:
        from tests.apps import common

        if self.schema:
            with self.engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        md = MetaData(schema=self.schema)
        for table in common.metadata.tables.values():
            table.to_metadata(md, schema=self.schema)
        md.create_all(self.engine)
        self.metadata = md

    def q(self, name: str) -> str:
        """A queue name unique to this test."""
        unique = f"{name}-{self.tag}"
        self.queues.add(unique)
        return unique

    @property
    def env(self) -> dict[str, str]:
        return {
            "MDB_TEST_LOG": str(self.log),
            "MDB_TEST_SCHEMA": self.schema or "",
            **CHILD_ENV,
            **(SQS_ENV if self.kind == "sqs" else {}),
        }

    def settings_data(self, ports: dict[str, Any], queues: dict[str, Any] | None = None,
                      topics: dict[str, Any] | None = None, listeners: list[str] | None = None,
                      **container: Any) -> dict[str, Any]:
        modules = listeners or sorted({f"tests.apps.{_module_of(p)}" for p in ports})
        base: dict[str, Any] = {
            "broker_url": self.broker_url,
            "database_url": self.database_url,
            "listeners": modules,
            "dead_letter_queue": self.q("DLQ"),
            "control_interval": "200ms",
            "shutdown_timeout": "20s",
        }
        if self.schema:
            base["db_schema"] = self.schema
        base.update(container)
        data: dict[str, Any] = {"container": base, "ports": ports}
        if queues:
            data["queues"] = queues
        if topics:
            data["topics"] = topics
        return data

    def write(self, name: str = "settings.toml", **kwargs: Any) -> Path:
        return write_settings(self.tmp / name, self.settings_data(**kwargs))

    def settings(self, path: Path) -> Settings:
        return load_settings(path, environ={})

    def container(self, path: Path, **kwargs: Any) -> ContainerProcess:
        return ContainerProcess(path, env=self.env, cwd=ROOT, **kwargs)

    def producer(self, path: Path) -> Producer:
        return Producer.from_settings(self.settings(path))

    def probe(self, path: Path) -> QueueProbe:
        key = (path, path.read_text())  # a settings file written anew gets a probe of its own
        if key not in self._probes:
            self._probes[key] = QueueProbe(self.settings(path))
        return self._probes[key]

    def effects(self, port: str | None = None) -> Counter[str]:
        table = self.metadata.tables[f"{self.schema}.effects" if self.schema else "effects"]
        query = table.select()
        if port:
            query = query.where(table.c.port == port)
        with self.engine.connect() as conn:
            return Counter(row.message_id for row in conn.execute(query))

    def attempts(self, port: str | None = None) -> list[tuple[str, str, str, int]]:
        if not self.log.exists():
            return []
        rows = []
        for line in self.log.read_text().splitlines():
            p, mid, action, count = line.split("\t")[:4]
            if port is None or p == port:
                rows.append((p, mid, action, int(count)))
        return rows

    def attempt_times(self, message_id: str) -> list[float]:
        """When each delivery of ``message_id`` reached its handler (epoch seconds)."""
        if not self.log.exists():
            return []
        return [float(line.split("\t")[4]) for line in self.log.read_text().splitlines()
                if line.split("\t")[1] == message_id]

    def in_flight(self, queue: str) -> int:
        """Messages of ``queue`` received and not yet deleted or visible again: on SQS, the ones a
        consumer holds and the ones a redelivery delay hides (``ApproximateNumberOfMessagesNotVisible``),
        which :meth:`QueueProbe.count` leaves out. 0 on the brokers, whose delayed messages wait on
        queues of their own and whose held ones are not counted."""
        if self.kind != "sqs":
            return 0
        from mdbcontainer.wire.sqs import sqs_name

        client = self.sqs_client()
        url = client.get_queue_url(QueueName=sqs_name(queue))["QueueUrl"]
        answer = client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
        return int(answer["Attributes"]["ApproximateNumberOfMessagesNotVisible"])

    def sqs_client(self) -> Any:
        """A boto3 SQS client on moto's server (one per backend: making one takes a tenth of a second)."""
        if self._sqs is None:
            import boto3

            self._sqs = boto3.client("sqs")
        return self._sqs

    def close(self) -> None:
        for probe in self._probes.values():
            probe.close()
        if self.kind == "rabbitmq":
            _delete_queues(self.queues)
        if self.schema:
            with self.engine.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()


def jms_settings(backend: Backend, queue: str, queues: dict[str, Any] | None = None,
                 **port: Any) -> Path:
    """Settings with port Jms (tests/apps/jms.py) on ``queue``; ``queues`` default to ``queue`` alone."""
    return backend.write(ports={"Jms": {"destination": queue, **port}}, queues=queues or {queue: {}},
                         listeners=["tests.apps.jms"])


def delayed_settings(backend: Backend, queue: str, port: dict[str, Any] | None = None,
                     **queue_keys: Any) -> Path:
    """Settings with port Delayed (tests/apps/delayed.py) on ``queue``; its wait queues are cleaned up."""
    backend.queues.update(wait_queues(queue, QueueSettings(**queue_keys)))
    return backend.write(ports={"Delayed": {"destination": queue, "max_retries": 100, **(port or {})}},
                         queues={queue: queue_keys})


@dataclass
class RawMessage:
    """The attributes of a kombu message the decode path reads (no ack: decoding never settles)."""

    body: bytes
    content_type: str
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    delivery_info: dict[str, Any] = field(default_factory=dict)
    content_encoding: str | None = None


def one_line_error(result: subprocess.CompletedProcess[str], code: int | None = None) -> str:
    """The one line an ``mdb`` failure prints on stderr (no traceback); checks the exit code if given."""
    if code is not None:
        assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def mdb_here(*args: str, settings: Path | None = None, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``mdb ARGS -c SETTINGS`` through the console entry point in this process: what
    :func:`mdbcontainer.testing.mdb` returns (exit code, stdout, stderr) without a Python start-up
    per call (a second or more on two busy cores).

    For the commands that end before they start a container (settings errors, ``mdb check``);
    one test per command path keeps the real process (``mdb()``) as a user types it. A listener
    module imported here stays imported in this process: give each test's module a name of its own.
    """
    from mdbcontainer.cli.main import main

    argv = ["mdb", *args, *(["-c", str(settings)] if settings is not None else [])]
    out, err = io.StringIO(), io.StringIO()
    saved = {key: os.environ.get(key) for key in (env or {})}
    where, argv_before, path_before = os.getcwd(), sys.argv, sys.path[:]  # listeners add their folder
    handlers, level = logging.root.handlers[:], logging.root.level  # ``mdb run`` sets up logging
    code: int
    try:
        os.environ.update(env or {})
        os.chdir(cwd or (Path(settings).parent if settings is not None else where))
        sys.argv = argv
        with redirect_stdout(out), redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        sys.argv = argv_before
        sys.path[:] = path_before
        os.chdir(where)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def rabbitmqctl(*args: str, timeout: float = 120.0) -> str:
    """Run ``rabbitmqctl`` on this machine's RabbitMQ; its output, or RuntimeError with its stderr."""
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip() or done.stdout}")
    return done.stdout


def _module_of(port: str) -> str:
    return {"Work": "work", "Bean": "bean", "Downstream": "downstream", "Typed": "typed",
            "Lifecycle": "lifecycle"}.get(port, port.lower())


def _delete_queues(names: set[str]) -> None:
    import kombu

    try:
        with kombu.Connection(RABBITMQ_URL, connect_timeout=3) as conn:
            channel = conn.channel()
            for name in names:
                try:
                    channel.queue_delete(queue=name)
                except Exception:
                    channel = conn.channel()
    except Exception:  # best-effort clean-up: a broker restarted by a test must not fail the next
        pass


@pytest.fixture(params=["embedded", pytest.param("rabbitmq", marks=[pytest.mark.rabbitmq, pytest.mark.postgres])])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    b = Backend(request.param, tmp_path)
    yield b
    b.close()


# The AWS environment of the SQS tests (moto's server, fixture ``moto_sqs``), set for this process
# and for every ``mdb`` child process of an SQS backend; filled in when the server starts.
SQS_ENV: dict[str, str] = {}


def _spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def moto_sqs() -> Any:
    """moto's SQS server on a spare port, for the whole session (of this xdist worker)."""
    import time

    port = _spare_port()
    # tests/moto_server.py: moto's server with a race of its own closed (a send dropped by a delete)
    server = subprocess.Popen([sys.executable, "-m", "tests.moto_server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 30
    while not reachable(port):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"moto's SQS server did not start on port {port}")
        time.sleep(0.1)
    SQS_ENV.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_DEFAULT_REGION="us-east-1",
                   AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    saved = {key: os.environ.get(key) for key in SQS_ENV}
    os.environ.update(SQS_ENV)
    yield SQS_ENV["AWS_ENDPOINT_URL"]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.kill()  # its state is memory only
    server.wait(10)


@pytest.fixture
def sqs(moto_sqs: str, tmp_path: Path) -> Any:
    """Amazon SQS (moto's server) + SQLite."""
    b = Backend("sqs", tmp_path)
    yield b
    b.close()


@pytest.fixture
def sqs_postgres(moto_sqs: str, tmp_path: Path) -> Any:
    """Amazon SQS (moto's server) + PostgreSQL, in a schema of its own: what users run SQS with
    (the SQS chaos run, whose database outage refuses a PostgreSQL role)."""
    b = Backend("sqs", tmp_path, database="postgres")
    yield b
    b.close()


@pytest.fixture(params=["embedded", pytest.param("rabbitmq", marks=[pytest.mark.rabbitmq, pytest.mark.postgres]),
                        "sqs"])
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Each of the three transports in turn: the behaviour tests that hold on every one of them."""
    if request.param == "sqs":
        request.getfixturevalue("moto_sqs")
    b = Backend(request.param, tmp_path)
    yield b
    b.close()


# A test whose point does not depend on the transport or the database (settings checking, figures,
# the pipeline's own logic) runs on one backend: ``@on_embedded`` keeps the ``backend`` argument and
# drops the RabbitMQ run (or ``@on_rabbitmq`` the embedded one). Each use says why in a comment;
# a test whose outcome the broker or the database decides keeps both.
on_embedded = pytest.mark.parametrize("backend", ["embedded"], indirect=True)
on_rabbitmq = pytest.mark.parametrize(
    "backend", [pytest.param("rabbitmq", marks=[pytest.mark.rabbitmq, pytest.mark.postgres])], indirect=True)


@pytest.fixture
def rabbit(tmp_path: Path) -> Any:
    """RabbitMQ + PostgreSQL only (crash tests that need broker delivery semantics)."""
    b = Backend("rabbitmq", tmp_path)
    yield b
    b.close()


@pytest.fixture
def embedded(tmp_path: Path) -> Any:
    """The embedded broker and SQLite only (the in-process tests of tests/pipeline and tests/units)."""
    b = Backend("embedded", tmp_path)
    yield b
    b.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest work first, so that no worker starts it last while the other idles.

    Under ``-n 3 --dist loadgroup`` the ``hosts`` group (network namespaces,
    RabbitMQ nodes) is one unit of several minutes on one worker, then come
    the ``slow`` tests; within each kind the collection order stays (a stable
    sort).
    """
    def weight(item: pytest.Item) -> int:
        if any(m.args[:1] == ("hosts",) for m in item.iter_markers("xdist_group")):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=weight)
