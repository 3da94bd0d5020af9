"""Findings of a review of the package against CONTRACT.md, each pinned by the behaviour a user sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kombu
import pytest
from sqlalchemy import text

from mdbcontainer.testing import wait_for, write_settings
from tests.conftest import RABBITMQ_URL, ROOT, Backend


def mdb(*args: str, settings: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mdbcontainer", *args, "-c", str(settings)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


# -- one-line errors, exit codes -------------------------------------------------------


@pytest.mark.rabbitmq
def test_a_refused_login_is_one_line_exit_1_without_the_password(rabbit: Backend) -> None:
    """Contract 5: a broker that cannot be reached is exit 1 and one line; a wrong password too."""
    bad = RABBITMQ_URL.replace("guest:guest", "guest:s3cret-pw")
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}}, broker_url=bad,
                            connect_timeout="2s")
    for args in (("send", rabbit.q("Q"), "{}"), ("dlq", "list")):
        result = mdb(*args, settings=settings, env=rabbit.env)
        line = one_line_error(result)
        assert result.returncode == 1, result.stderr
        assert "s3cret-pw" not in result.stderr + result.stdout
        assert "ACCESS_REFUSED" in line and "guest:***@" in line


@pytest.mark.rabbitmq
def test_a_refused_login_is_an_outage_mdb_run_retries_not_a_port_failure(rabbit: Backend) -> None:
    """A wrong password is waited out like an unreachable broker, not a consumer error that stops
    the port for the whole fleet (and keeps it stopped after the password is fixed)."""
    queue = rabbit.q("Q")
    bad = RABBITMQ_URL.replace("guest:guest", "guest:s3cret-pw")
    settings = rabbit.write(ports={"Work": {"destination": queue}}, broker_url=bad)
    with rabbit.container(settings).start(wait=False) as container:
        wait_for(lambda: "broker unavailable" in container.output(), what="the outage line")
        assert "ACCESS_REFUSED" in container.output()
        assert container.alive()
    assert "consumer error" not in container.output()
    assert "s3cret-pw" not in container.output()
    with rabbit.engine.connect() as conn:
        rows = conn.execute(text(f'SELECT name, state FROM "{rabbit.schema}".mdb_port')).all()
    assert rows == [], "no fleet-wide stop was written"


@pytest.mark.rabbitmq
def test_a_queue_declare_the_broker_refuses_is_one_line_exit_1(rabbit: Backend) -> None:
    """A queue that exists with other arguments (PRECONDITION_FAILED) is a reported failure."""
    queue = rabbit.q("PRIO")
    with kombu.Connection(RABBITMQ_URL) as conn:
        conn.channel().queue_declare(queue=queue, durable=True, auto_delete=False,
                                     arguments={"x-max-priority": 5})
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}})
    result = mdb("send", queue, "{}", settings=settings, env=rabbit.env)
    line = one_line_error(result)
    assert result.returncode == 1
    assert queue in line and "PRECONDITION_FAILED" in line


def test_an_unknown_port_name_is_bad_usage_exit_2(tmp_path: Path) -> None:
    """Contract 5: exit 2 for a bad argument, as ``mdb run --port NAME`` already does."""
    settings = write_settings(tmp_path / "settings.toml", {
        "container": {
            "broker_url": f"embedded://{tmp_path / 'broker.db'}",
            "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
            "listeners": ["tests.apps.work"],
        },
        "ports": {"Work": {"destination": "WORK"}},
    })
    for verb in ("start", "stop"):
        result = mdb("port", verb, "Wrok", settings=settings)
        line = one_line_error(result)
        assert result.returncode == 2, result.stderr
        assert "'Wrok'" in line and "Work" in line


# -- publishing ----------------------------------------------------------------------------


def outbox_rows(backend: Backend) -> int:
    table = f'"{backend.schema}".mdb_outbox' if backend.schema else "mdb_outbox"
    with backend.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar() or 0)


def test_an_outbox_send_to_a_topic_nobody_subscribes_leaves_and_is_dropped(backend: Backend) -> None:
    """Contract 4: a publish to a topic is confirmed, not mandatory: with no subscription the
    message is dropped. The outbox must not keep it because the topic was never declared."""
    queue, topic = backend.q("Q"), backend.q("events")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}},
                             topics={topic: {}})
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "send", "to": topic}, message_id="m1")
        wait_for(lambda: backend.effects() == {"m1": 1}, what="the handler's work")
        wait_for(lambda: outbox_rows(backend) == 0, timeout=10, what="the outbox row to leave")
        output = container.output()
    assert "deferred" not in output and "not published" not in output, output


# -- operations ----------------------------------------------------------------------------


@pytest.mark.slow
def test_port_start_while_a_stopped_port_still_finishes_a_long_delivery(backend: Backend) -> None:
    """Contract 4: ``mdb port start NAME`` starts a stopped port again. A request made while
    another consumer still finishes a long delivery (over the control loop's 5 s join) must
    start the port once that delivery ends, not be forgotten."""
    queue = backend.q("Q")
    settings = backend.write(ports={"Work": {"destination": queue, "concurrency": 2,
                                             "prefetch": 1}},
                             queues={queue: {"backout_threshold": 1}})
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "sleep", "seconds": 9}, message_id="slow")
            wait_for(lambda: [a for a in backend.attempts() if a[1] == "slow"], what="slow start")
            producer.send(queue, {"n": 2, "action": "fail"}, message_id="poison")
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped",
                 what="the port to stop")
        assert "slow" not in backend.effects(), "the long delivery is still running"
        assert mdb("port", "start", "Work", settings=settings, env=backend.env).returncode == 0
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "started",
                 timeout=30, what="the port to start after the long delivery")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1,
                 what="the poison message backed out after the restart")
    assert backend.effects() == {"slow": 1}


# -- what counts as a failed delivery -------------------------------------------------------


def test_a_handler_sql_error_is_a_failed_delivery_not_a_database_outage(backend: Backend) -> None:
    """Contract 4: the handler raised, so the delivery failed and counts. SQLite reports a
    missing table as OperationalError, the class of lost connections; it must not be
    waited out as an outage forever, never counted and never backed out."""
    queue = backend.q("Q")
    settings = backend.write(ports={"Review": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 2}})
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"action": "badsql"}, message_id="bad")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, timeout=15,
                 what="the message backed out after two failed deliveries")
        output = container.output()
    assert "database unavailable" not in output, output
    assert [a[3] for a in backend.attempts()] == [0, 1]
    dead = backend.probe(settings).take_all(backend.q("DLQ"))
    assert "review_no_such_table" in dict(dead[0].headers)["x-mdb-exception"]


# -- the envelope ----------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_a_message_without_delivery_mode_is_not_persistent(rabbit: Backend) -> None:
    """Contract 2: ``persistent``. AMQP without a delivery_mode is transient (RabbitMQ keeps it
    in memory only), so a producer from elsewhere that sets none must not read as persistent."""
    import amqp

    queue = rabbit.q("Q")
    settings = rabbit.write(ports={"Review": {"destination": queue}}, queues={queue: {}})
    with rabbit.container(settings):
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1}, message_id="ours")
            producer.send(queue, {"n": 2}, message_id="ours-transient", persistent=False)
        with kombu.Connection(RABBITMQ_URL) as conn:
            raw = amqp.Message(b'{"n": 3}', content_type="application/json", message_id="foreign")
            conn.default_channel.basic_publish(raw, exchange="", routing_key=queue)
        seen = Path(str(rabbit.log) + ".review")
        wait_for(lambda: seen.exists() and len(seen.read_text().splitlines()) == 3,
                 what="three deliveries")
    persistent = {row["id"]: row["persistent"] for row in map(json.loads, seen.read_text().splitlines())}
    assert persistent == {"ours": True, "ours-transient": False, "foreign": False}


def test_a_ttl_that_is_not_positive_is_bad_usage_exit_2(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
    }})
    result = mdb("send", "Q", "{}", "--ttl", "0s", settings=settings)
    line = one_line_error(result)
    assert result.returncode == 2
    assert "--ttl" in line


# -- beans -----------------------------------------------------------------------------------


def test_a_bean_whose_teardown_raises_still_fails_with_its_own_error() -> None:
    """Contract 1: a bean that raised is discarded (teardown) and replaced. A teardown that
    raises too must not replace the handler's error (the one x-mdb-exception reports)."""
    from mdbcontainer.handlers import HandlerSpec, Invoker

    class Bean:
        def on_message(self, message: object, ctx: object) -> None:
            raise RuntimeError("the handler's own error")

        def teardown(self) -> None:
            raise OSError("teardown failed too")

    invoker = Invoker.for_spec(HandlerSpec("P", Bean, {}))
    with pytest.raises(RuntimeError, match="the handler's own error"):
        invoker("body", None)
    invoker._bean = Bean()
    invoker.discard()  # at shutdown: logged, not raised out of the consumer thread
    assert invoker._bean is None


def test_the_exception_kept_in_x_mdb_exception_masks_passwords() -> None:
    """Contract 3: secrets never appear in errors; x-mdb-exception is printed by mdb dlq show."""
    from mdbcontainer.counts import exception_text

    try:
        raise RuntimeError("cannot reach https://svc:hunter2@api.example/ (password=hunter2)")
    except RuntimeError as exc:
        text = exception_text(exc)
    assert "hunter2" not in text
    assert "RuntimeError: cannot reach https://svc:***@api.example/" in text


# -- replay ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_message_the_handler_moved_is_handled_again_when_replayed(backend: Backend) -> None:
    """Contract 2 and 5: ``ctx.move_to`` counts as handled, so the dedup row of the message
    commits with the move; ``mdb dlq replay`` must still bring the message back to its
    handler, not have it acknowledged as a duplicate of the delivery that moved it."""
    queue, dlq = backend.q("Q"), backend.q("DLQ")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with backend.container(settings):
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "move", "to": dlq}, message_id="parked")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="the move")
        result = mdb("dlq", "replay", "parked", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: len([a for a in backend.attempts() if a[1] == "parked"]) == 2,
                 what="the replayed copy to reach the handler")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="moved again")


@pytest.mark.slow
def test_a_replay_killed_mid_way_and_run_again_still_applies_a_backed_out_message_once(
    backend: Backend,
) -> None:
    """The replay's crash window (confirmed copy, original not yet acknowledged) duplicates the
    copy; the dedup row of the first copy must absorb the second (README, dlq.py)."""
    import signal

    queue, dlq = backend.q("Q"), backend.q("DLQ")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 1}})
    keys = backend.metadata.tables[f"{backend.schema}.unique_keys" if backend.schema
                                   else "unique_keys"]
    with backend.engine.begin() as conn:  # the data fault that makes the message fail at commit
        conn.execute(keys.insert().values(key="always-the-same"))
    with backend.container(settings):
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "constraint"}, message_id="m")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="the backout")
        with backend.engine.begin() as conn:
            conn.execute(keys.delete())
        crashed = mdb("dlq", "replay", "m", settings=settings,
                      env={**backend.env, "MDB_CRASH_AT": "mid-replay"})
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        wait_for(lambda: backend.effects() == {"m": 1}, what="the first copy handled")
        result = mdb("dlq", "replay", "m", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: backend.probe(settings).count(queue) == 0 and
                 len([a for a in backend.attempts() if a[1] == "m"]) >= 2,
                 what="the second copy consumed")
        wait_for(lambda: backend.probe(settings).count(dlq) == 0, what="the DLQ empty")
    assert backend.effects() == {"m": 1}


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("queues", [{}, {"DLQ": {"backout_queue": "DLQ"}}])
def test_a_port_whose_queue_is_its_own_backout_queue_is_a_settings_error(
    tmp_path: Path, queues: dict[str, object],
) -> None:
    """A port that reads the backout queue (a DLQ processor) would back a failing message out
    onto the queue it reads, where it fails again, for ever: contract 3 makes such
    contradictory combinations settings errors (exit 2, one line)."""
    settings = write_settings(tmp_path / "settings.toml", {
        "container": {
            "broker_url": f"embedded://{tmp_path / 'broker.db'}",
            "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
            "listeners": ["tests.apps.work"], "dead_letter_queue": "DLQ",
        },
        "queues": queues,
        "ports": {"Work": {"destination": "DLQ"}},
    })
    for verb in ("check", "run"):
        result = mdb(verb, settings=settings)
        line = one_line_error(result)
        assert result.returncode == 2, result.stderr
        assert "ports.Work" in line and "backout" in line
    ok = settings.read_text() + '\n[queues.DLQ]\nbackout_threshold = 0\n' if not queues else None
    if ok:
        settings.write_text(ok)
        assert mdb("check", settings=settings).returncode == 0, "threshold 0: nothing backed out"


@pytest.mark.rabbitmq
def test_a_queue_deleted_under_a_long_lived_producer_is_declared_again(rabbit: Backend) -> None:
    """A publisher declares each destination once. After the queue is deleted (an operator,
    ``rabbitmqctl delete_queue``), a mandatory publish returns: that one fails, and the
    next must declare the queue again instead of failing for the life of the publisher
    (the outbox relay would retry the row for ever)."""
    from mdbcontainer.errors import Unroutable

    queue = rabbit.q("Q")
    settings = rabbit.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with rabbit.producer(settings) as producer:
        producer.send(queue, {"n": 1})
        with kombu.Connection(RABBITMQ_URL) as conn:
            conn.channel().queue_delete(queue=queue)
        with pytest.raises(Unroutable):
            producer.send(queue, {"n": 2})
        producer.send(queue, {"n": 3})
    assert rabbit.probe(settings).count(queue) == 1


def test_a_control_interval_of_zero_is_a_settings_error(tmp_path: Path) -> None:
    """A zero interval made the control loop poll the database without pause (a busy loop)."""
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "listeners": ["tests.apps.work"], "control_interval": "0s",
    }, "ports": {"Work": {"destination": "WORK"}}})
    result = mdb("check", settings=settings)
    line = one_line_error(result)
    assert result.returncode == 2
    assert "container.control_interval" in line


def test_a_broker_url_of_no_supported_kind_is_a_settings_error(tmp_path: Path) -> None:
    """mdb check said ok and mdb send ended in a KeyError traceback ('No such transport')."""
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "rabbit://guest:s3cret-pw@127.0.0.1//",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "listeners": ["tests.apps.work"],
    }, "ports": {"Work": {"destination": "WORK"}}})
    for args in (("check",), ("send", "Q", "{}")):
        result = mdb(*args, settings=settings)
        line = one_line_error(result)
        assert result.returncode == 2
        assert "container.broker_url" in line and "amqp://" in line
        assert "s3cret-pw" not in result.stderr
