"""The container process as a user runs it: shutdown, crashes, restarts, several replicas."""

from __future__ import annotations

import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from tests.conftest import RABBITMQ_URL, ROOT, Backend, on_embedded, rabbitmqctl

pytestmark = pytest.mark.slow


# The stack dump is the process's own signal handler; no broker or database takes part.
@on_embedded
def test_sigusr1_prints_every_threads_stack_and_the_container_runs_on(backend: Backend) -> None:
    """What an operator sends to see where a stop or a handler hangs (README: Shutdown)."""
    queue = backend.q("Q")
    settings = backend.write(ports={"Work": {"destination": queue, "concurrency": 2}})
    with backend.container(settings) as container:
        assert container.proc is not None
        container.proc.send_signal(signal.SIGUSR1)

        def stacks() -> bool:  # main, the two consumers, the loops: written while we read
            output = container.output()
            return (output.count("hread 0x") >= 4 and "Current thread 0x" in output
                    and "runtime/container.py" in output and "runtime/port.py" in output)

        try:
            wait_for(stacks, what="every thread's stack on stderr")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{container.output()[-3000:]}") from None
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1}, message_id="after")
        wait_for(lambda: backend.effects() == {"after": 1}, what="a message handled afterwards")
        assert container.terminate() == 0


def test_sigterm_mid_stream_loses_nothing_and_exits_0(transport: Backend) -> None:
    queue = transport.q("STREAM")
    settings = transport.write(
        ports={"Work": {"destination": queue, "concurrency": 2, "prefetch": 20}},
    )
    ids = [f"m{i}" for i in range(200)]
    with transport.producer(settings) as producer:
        for n, mid in enumerate(ids):
            producer.send(queue, {"n": n, "action": "sleep", "seconds": 0.05}, message_id=mid)
    container = transport.container(settings).start()
    wait_for(lambda: len(transport.effects()) >= 20, what="some messages handled")
    assert container.terminate() == 0
    handled_before = sum(transport.effects().values())
    assert handled_before < len(ids), "stopped mid-stream"
    assert "container shutting down" in container.output()
    with transport.container(settings):
        wait_for(lambda: len(transport.effects()) == len(ids), timeout=60, what="every message")
    assert set(transport.effects()) == set(ids)
    assert set(transport.effects().values()) == {1}, "each applied once"
    assert transport.probe(settings).count(transport.q("DLQ")) == 0
    handed_back = [a for a in transport.attempts() if a[3] > 0]
    assert not handed_back, "a graceful stop does not count handed-back messages as failures"


# The order of the shutdown's log lines is the port's; what a stop hands back to each broker is
# test_sigterm_mid_stream_loses_nothing_and_exits_0's, on both backends.
@on_embedded
def test_shutdown_says_it_waits_for_a_running_handler_before_the_port_stops(
    backend: Backend,
) -> None:
    queue = backend.q("SLOWSTOP")
    settings = backend.write(ports={"Work": {"destination": queue}})
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "sleep", "seconds": 2}, message_id="slow")
    container = backend.container(settings).start()
    wait_for(lambda: backend.attempts(), what="the slow handler to start")
    assert container.terminate() == 0
    assert backend.effects() == {"slow": 1}, "the handler finished and committed"
    lines = container.output().splitlines()
    waiting = next(i for i, line in enumerate(lines)
                   if "port Work stopping: waiting for 1 in-flight delivery" in line)
    stopped = next(i for i, line in enumerate(lines)
                   if "port Work stopped: container shutting down" in line)
    assert waiting < stopped

    def at(line: str) -> datetime:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    assert (at(lines[stopped]) - at(lines[waiting])).total_seconds() > 1.0, (
        "the stop is logged once the handler is done, not while it sleeps")


def test_second_signal_exits_at_once_and_still_loses_nothing(backend: Backend) -> None:
    queue = backend.q("SLOW")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}})
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "sleep", "seconds": 30}, message_id="slow")
    container = backend.container(settings).start()
    wait_for(lambda: backend.attempts(), what="the slow handler to start")
    assert container.proc is not None
    container.proc.send_signal(15)
    time.sleep(0.5)
    container.proc.send_signal(15)
    assert container.wait_exit(10) == 130
    assert backend.effects() == {}
    assert backend.probe(settings).count(queue) == 1, "the unfinished message is back on its queue"


def test_a_message_that_kills_the_container_ends_in_the_backout_queue(backend: Backend) -> None:
    queue = backend.q("KILLER")
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1, "concurrency": 1}},
        queues={queue: {"backout_threshold": 3}},
    )
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 0}, message_id="before")
        producer.send(queue, {"n": 1, "action": "kill"}, message_id="killer")
        for n in range(2, 12):
            producer.send(queue, {"n": n}, message_id=f"good-{n}")
    dlq = backend.q("DLQ")
    probe = backend.probe(settings)
    crashes = 0
    while True:
        container = backend.container(settings).start(wait=False)
        wait_for(lambda c=container: not c.alive() or (probe.exists(dlq) and probe.count(dlq)),
                 timeout=60, what="a crash or the backout")
        if container.alive():
            break
        crashes += 1
        assert crashes <= 5, "the killer message loops instead of being backed out"
    assert crashes == 3, "three deliveries killed the process, the fourth backed it out"
    with container:
        wait_for(lambda: len(backend.effects()) == 11, what="every good message")
    assert set(backend.effects().values()) == {1}
    killer = [a for a in backend.attempts() if a[1] == "killer"]
    assert [a[3] for a in killer] == [0, 1, 2], "each crash counted once"
    [dead] = backend.probe(settings).take_all(backend.q("DLQ"))
    headers = dict(dead.headers)
    assert headers["x-mdb-redelivery-count"] == 3
    assert "process died" in headers["x-mdb-exception"]


def test_port_stop_and_start_act_on_every_replica(backend: Backend) -> None:
    queue = backend.q("FLEET")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}})
    # Both start at once (each start is a Python start-up and a connect); the test waits for both.
    one = backend.container(settings).start(wait=False)
    two = backend.container(settings, log_path=backend.tmp / "two.log").start(wait=False)
    with one, two:
        one.wait_started()
        two.wait_started()
        result = mdb("ports", "--json", settings=settings, env=backend.env)
        import json

        rows = json.loads(result.stdout)
        assert {r["container"].split(":")[-2] for r in rows} == {str(one.pid), str(two.pid)}
        assert {r["state"] for r in rows} == {"started"}
        assert set(rows[0]) >= {"container", "port", "destination", "state", "reason",
                                "consecutive_failures", "delivered", "failed", "backed_out",
                                "expired", "since"}
        stop = mdb("port", "stop", "Work", settings=settings, env=backend.env)
        assert stop.returncode == 0, stop.stderr
        for replica in (one, two):
            wait_for(lambda r=replica: (r.port_state("Work") or {}).get("state") == "stopped",
                     timeout=5, what="stop within a couple of seconds")
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1}, message_id="while-stopped")
        time.sleep(1)
        assert backend.effects() == {}, "a stopped port consumes nothing"
        start = mdb("port", "start", "Work", settings=settings, env=backend.env)
        assert start.returncode == 0, start.stderr
        wait_for(lambda: backend.effects() == {"while-stopped": 1}, timeout=5, what="restart")
        for replica in (one, two):
            wait_for(lambda r=replica: r.port_state("Work")["state"] == "started", timeout=5,
                     what="started again")


# ``--port`` picks what the container starts, whatever the transport.
@on_embedded
def test_run_only_named_ports(backend: Backend) -> None:
    work, bean = backend.q("W"), backend.q("B")
    settings = backend.write(ports={"Work": {"destination": work}, "Bean": {"destination": bean}})
    with ContainerProcess(settings, ports=["Bean"], env=backend.env, cwd=ROOT) as container:
        assert [r["port"] for r in container.rows()] == ["Bean"]


# The broker is an AMQP address nobody listens on, whatever the backend: one run says it all.
@on_embedded
def test_broker_unreachable_at_start_is_retried_with_a_visible_log_line(backend: Backend) -> None:
    queue = backend.q("LATE")
    settings = backend.write(ports={"Work": {"destination": queue}},
                             broker_url="amqp://guest:guest@127.0.0.1:1//")
    container = backend.container(settings).start(wait=False)
    try:
        wait_for(lambda: "broker unavailable" in container.output(), timeout=15,
                 what="the outage log line")
        assert container.alive(), "mdb run keeps retrying"
        assert container.output().count("broker unavailable") == 1, "logged once per outage"
        assert "guest:guest" not in container.output()
    finally:
        container.kill()


# The database is a PostgreSQL address nobody listens on, whatever the backend: one run says it all.
@on_embedded
def test_database_unreachable_at_start_is_retried_and_cli_says_so_in_one_line(backend: Backend) -> None:
    settings = backend.write(ports={"Work": {"destination": backend.q("NODB")}},
                             database_url="postgresql+psycopg://postgres:pw@127.0.0.1:1/test")
    container = backend.container(settings).start(wait=False)
    try:
        wait_for(lambda: container.output().count("database unavailable at start") >= 2, timeout=15,
                 what="retries with a log line each")
        assert container.alive()
        assert container.terminate() == 0
    finally:
        container.kill()
    result = mdb("ports", settings=settings, env=backend.env)
    assert result.returncode == 1
    assert result.stderr.startswith("mdb: error: database: OperationalError")
    assert len(result.stderr.strip().splitlines()) == 1 and ":pw@" not in result.stderr


# The bean's setup and teardown are the handler registry's; no broker or database decides them.
@on_embedded
def test_a_bean_that_raised_is_discarded_and_replaced(backend: Backend) -> None:
    queue = backend.q("BEANS")
    settings = backend.write(ports={"Lifecycle": {"destination": queue, "prefetch": 1}},
                             queues={queue: {"backout_threshold": 1}})
    with backend.producer(settings) as producer:
        for mid, action in (("a", "ok"), ("b", "fail"), ("c", "ok")):
            producer.send(queue, {"action": action}, message_id=mid)
    events_file = Path(str(backend.log) + ".lifecycle")
    with backend.container(settings) as container:
        wait_for(lambda: events_file.exists() and "message 2 c" in events_file.read_text(),
                 what="the third message on a new instance")
        assert container.terminate() == 0
    events = events_file.read_text().splitlines()
    assert events == ["setup 1", "message 1 a", "message 1 b", "teardown 1",
                      "setup 2", "message 2 c", "teardown 2"]


@pytest.mark.rabbitmq
def test_a_login_refused_while_running_is_an_outage_not_a_port_failure(rabbit: Backend) -> None:
    """A password changed under a running container is waited out like an unreachable broker, not
    a consumer error that stops the port for the whole fleet (and keeps it stopped after the
    password is fixed). At start the same refusal is a settings error (tests/behaviour/test_cli.py)."""
    from tests.chaos import faults

    user = f"mdb-{rabbit.tag}"
    rabbitmqctl("add_user", user, "first-pw")
    try:
        rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        queue = rabbit.q("Q")
        settings = rabbit.write(ports={"Work": {"destination": queue}},
                                broker_url=RABBITMQ_URL.replace("guest:guest", f"{user}:first-pw"))
        with rabbit.container(settings) as container:
            rabbitmqctl("change_password", user, "s3cret-pw")
            faults.close_broker_connections(container.pid)
            wait_for(lambda: "broker unavailable" in container.output(), what="the outage line")
            time.sleep(3)  # reconnections refused with ACCESS_REFUSED meanwhile
            assert container.alive()
            rabbitmqctl("change_password", user, "first-pw")
            with rabbit.producer(settings) as producer:
                producer.send(queue, {"n": 1}, message_id="after")
            wait_for(lambda: rabbit.effects().get("after"), timeout=60, what="a delivery after the fix")
        assert "consumer error" not in container.output()
        assert "first-pw" not in container.output()
    finally:
        rabbitmqctl("delete_user", user)
    with rabbit.engine.connect() as conn:
        rows = conn.execute(text(f'SELECT name, state FROM "{rabbit.schema}".mdb_port')).all()
    assert rows == [], "no fleet-wide stop was written"


# The pending start request is the control loop's (the port's row is written alike on both
# databases, test_port_stop_and_start_act_on_every_replica runs on both).
@on_embedded
def test_port_start_while_a_stopped_port_still_finishes_a_long_delivery(backend: Backend) -> None:
    """``mdb port start NAME`` starts a stopped port again. A request made while
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


def test_a_bean_whose_teardown_raises_still_fails_with_its_own_error() -> None:
    """A bean that raised is discarded (teardown) and replaced. A teardown that
    raises too must not replace the handler's error (the one x-mdb-exception reports)."""
    from mdbcontainer.handlers.registry import HandlerSpec, Invoker

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
