"""Operating the container: /metrics, /healthz, /readyz, structured logs, ``mdb ports --watch``.

Everything is read the way an operator's tools read it: Prometheus scrapes the
HTTP endpoint, a Kubernetes probe looks at the status code and the JSON
reason, a log stack parses JSON lines, a person runs the CLI.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from mdbcontainer.sending.producer import Outgoing, outgoing
from mdbcontainer.support.logs import JsonFormatter, MaskingFilter, TextFormatter
from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from tests.behaviour.helpers import free_port, get, scrape
from tests.chaos.faults import disruptive_lock
from tests.conftest import ROOT, Backend, on_embedded, rabbitmqctl

pytestmark = pytest.mark.slow

OUTCOMES = ("handled", "failed", "backed_out", "duplicate_skipped", "expired", "invalid_body")


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, body = get(port, path)
    return status, json.loads(body)


def deliveries(samples: dict[Any, float], port: str) -> dict[str, float]:
    return {o: samples.get(("mdb_deliveries_total", (("outcome", o), ("port", port))), -1.0)
            for o in OUTCOMES}


def stale_message(queue: str, message_id: str) -> Outgoing:
    """Sent an hour ago with a minute to live: the broker keeps it, the container finds it expired."""
    fresh = outgoing(queue, {"n": message_id}, ttl="60s", message_id=message_id)
    return Outgoing(queue, fresh.body, {**fresh.properties, "timestamp": int(time.time()) - 3600})


def foreign_body(queue: str, message_id: str) -> Outgoing:
    """A body in a content type the port does not accept: poison the container sees."""
    props = {"message_id": message_id, "content_type": "application/xml", "delivery_mode": 2,
             "headers": {}}
    return Outgoing(queue, b"<order/>", props)


# -- /metrics -------------------------------------------------------------------------------


# The figures are the port's own counters served over HTTP; the outcomes they count are checked on
# both backends where the broker or the database decides them (tests/behaviour/test_poison.py...).
@on_embedded
def test_metrics_count_every_outcome_and_show_idle_ports_at_zero(backend: Backend) -> None:
    queue, idle = backend.q("ORDERS"), backend.q("IDLE")
    port = free_port()
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 5, "prefetch": 1},
               "Bean": {"destination": idle, "autostart": False}},
        queues={queue: {"backout_threshold": 2}, idle: {}}, metrics_port=port,
    )
    with backend.producer(settings) as producer:
        for n in range(3):
            producer.send(queue, {"n": n}, message_id=f"ok-{n}")
        producer.send(queue, {"n": 10, "action": "fail"}, message_id="poison")
        producer.send(queue, {"n": 20}, message_id="twice")
        producer.send(queue, {"n": 20}, message_id="twice")
        producer.publish(stale_message(queue, "stale"))
        producer.publish(foreign_body(queue, "xml"))
    expected = {"handled": 4, "failed": 2, "backed_out": 1, "duplicate_skipped": 1,
                "expired": 1, "invalid_body": 1}
    with backend.container(settings).start(wait=False) as container:
        container.wait_started(ports=["Work"])
        wait_for(lambda: deliveries(scrape(port), "Work") == expected, timeout=30,
                 what=f"the counts {expected}")
        samples = scrape(port)
    labels = (("port", "Work"),)
    assert samples[("mdb_port_started", labels)] == 1
    assert samples[("mdb_port_consecutive_failures", labels)] == 0, "the backout reset the count"
    assert samples[("mdb_deliveries_in_flight", labels)] == 0
    assert samples[("mdb_handler_seconds_count", labels)] == 7, "4 handled, 2 failed, 1 duplicate"
    assert samples[("mdb_end_to_end_seconds_count", labels)] == 4, "handled deliveries only"
    assert samples[("mdb_end_to_end_seconds_sum", labels)] < 4 * 30
    assert deliveries(samples, "Bean") == dict.fromkeys(OUTCOMES, 0), "an idle port's series exist"
    assert samples[("mdb_port_started", (("port", "Bean"),))] == 0, "autostart = false: stopped"
    assert samples[("mdb_outbox_backlog", ())] == 0
    assert samples[("mdb_dedup_rows_purged_total", ())] == 0


# The gauges are the port's own figures served over HTTP; no broker or database decides them.
@on_embedded
def test_gauges_show_a_delivery_in_flight_and_consecutive_failures(backend: Backend) -> None:
    queue = backend.q("SLOW")
    port = free_port()
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 0}}, metrics_port=port)
    labels = (("port", "Work"),)
    with backend.container(settings) as container, backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "sleep", "seconds": 3}, message_id="slow")
        wait_for(lambda: scrape(port)[("mdb_deliveries_in_flight", labels)] == 1, what="in flight")
        assert probe(port, "/healthz")[0] == 200, "a long handler is not a wedged consumer"
        wait_for(lambda: scrape(port)[("mdb_deliveries_in_flight", labels)] == 0, what="done")
        producer.send(queue, {"n": 2, "action": "fail"}, message_id="bad")
        wait_for(lambda: scrape(port)[("mdb_port_consecutive_failures", labels)] >= 3,
                 what="consecutive failures")
        assert container.alive()


# -- /healthz and /readyz -----------------------------------------------------------------------


# /readyz reads the ports' states in the process; the states themselves are checked on both backends.
@on_embedded
def test_readyz_follows_the_ports_and_healthz_stays_up(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    port = free_port()
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}},
                             metrics_port=port)
    with backend.container(settings) as container:
        assert probe(port, "/readyz") == (200, {"status": "ready", "reasons": [],
                                                "ports": {"Work": "started"}})
        assert probe(port, "/healthz")[0] == 200
        stopped = mdb("port", "stop", "Work", "--json", settings=settings, env=backend.env)
        assert json.loads(stopped.stdout) == {"port": "Work", "requested": "stopped", "within": "200ms"}
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped",
                 what="the port to stop")
        assert probe(port, "/readyz")[0] == 200, "stopped by a person: stopped as configured"
        assert mdb("port", "start", "Work", settings=settings, env=backend.env).returncode == 0
        container.wait_started()
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison")
        wait_for(lambda: probe(port, "/readyz")[0] == 503, what="readyz to fail")
        _, body = probe(port, "/readyz")
        assert body["status"] == "not ready" and body["ports"] == {"Work": "stopped"}
        assert body["reasons"][0].startswith("port Work stopped: maximum retries (0) exceeded")
        assert "poison" in body["reasons"][0]
        assert probe(port, "/healthz") == (200, {"status": "alive", "reasons": [],
                                                 "ports": {"Work": "stopped"}})
        assert get(port, "/nothing")[0] == 404


def test_dedup_purge_speaks_json_for_scripts(backend: Backend) -> None:
    settings = backend.write(ports={"Work": {"destination": backend.q("Q")}})
    result = mdb("dedup", "purge", "--older-than", "1d", "--json", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"removed": 0, "older_than": "1d"}


# A local HTTP port taken: refused the same way whatever the transport.
@on_embedded
def test_a_taken_metrics_port_is_one_line_naming_the_setting(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}},
                                 metrics_port=port, metrics_host="127.0.0.1")
        result = mdb("run", settings=settings, env=backend.env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("mdb: error:") and "container.metrics_port" in lines[-1]
    assert f"127.0.0.1:{port}" in lines[-1] and "Traceback" not in result.stderr


@pytest.mark.disruptive
def test_readyz_fails_while_rabbitmq_is_stopped_and_recovers(rabbit: Backend) -> None:
    queue = rabbit.q("ORDERS")
    port = free_port()
    settings = rabbit.write(ports={"Work": {"destination": queue}}, queues={queue: {}},
                            metrics_port=port)
    with rabbit.container(settings) as container:
        wait_for(lambda: probe(port, "/readyz")[0] == 200, what="ready")
        with disruptive_lock():
            try:
                rabbitmqctl("stop_app")
                wait_for(lambda: probe(port, "/readyz")[0] == 503, timeout=30, what="not ready")
                _, body = probe(port, "/readyz")
                assert any(r.startswith("broker unavailable for") for r in body["reasons"]), body
                assert probe(port, "/healthz")[0] == 200, "an outage is not a reason to restart"
            finally:
                rabbitmqctl("start_app")
                rabbitmqctl("await_startup")
                wait_for(lambda: amqp_accepts(), timeout=120, interval=1, what="RabbitMQ back")
        wait_for(lambda: probe(port, "/readyz")[0] == 200, timeout=60, what="ready again")
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1}, message_id="after")
        wait_for(lambda: "after" in rabbit.effects(), what="a delivery after the outage")
        output = container.output()
    assert output.count("broker unavailable") == 1, "the outage is logged once"
    assert "broker connection restored after" in output
    assert "guest:guest" not in output


def amqp_accepts() -> bool:
    import kombu

    try:
        with kombu.Connection("amqp://guest:guest@127.0.0.1:5672//", connect_timeout=2) as conn:
            conn.connect()
            return True
    except Exception:
        return False


# -- logs -----------------------------------------------------------------------------------


# The log lines' shape is the formatter's; the failures and the backout they report are the same
# pipeline steps on both transports (tests/behaviour/test_poison.py runs those on both).
@on_embedded
def test_json_logs_carry_the_facts_of_failures_backouts_and_state_changes(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 2, "prefetch": 1}},
                             queues={queue: {"backout_threshold": 2}}, log_format="json")
    with backend.producer(settings) as producer:
        for n in range(5):
            producer.send(queue, {"n": n}, message_id=f"ok-{n}")
        producer.send(queue, {"n": 9, "action": "fail"}, message_id="poison")
    with backend.container(settings) as container:
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        wait_for(lambda: len(backend.effects()) == 5, what="good messages")
        output = container.output()
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == len(output.splitlines()), "every line is JSON"
    failures = [e for e in lines if e.get("outcome") == "failed"]
    assert [(e["port"], e["message_id"], e["redelivery_count"]) for e in failures] == [
        ("Work", "poison", 0), ("Work", "poison", 1)]
    assert all(e["level"] == "WARNING" and isinstance(e["duration"], float) for e in failures)
    backout = [e for e in lines if e.get("outcome") == "backed_out"]
    assert [(e["port"], e["message_id"], e["redelivery_count"]) for e in backout] == [
        ("Work", "poison", 2)]
    assert backend.q("DLQ") in backout[0]["message"]
    started = [e for e in lines if e.get("state") == "started"]
    assert started and started[0]["port"] == "Work"
    assert not [e for e in lines if "ok-" in e["message"]], "nothing per successful message"


# The log lines' shape is the formatter's, whatever the transport.
@on_embedded
def test_text_logs_say_port_message_count_and_duration(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1}, message_id="fine")
        producer.send(queue, {"n": 2, "action": "fail"}, message_id="poison")
    with backend.container(settings).start(wait=False) as container:
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped"
                 and "port Work stopped" in container.output(), what="the port to stop")
        output = container.output()
    failed = [line for line in output.splitlines() if "delivery failed" in line]
    assert len(failed) == 1
    assert "port Work: delivery failed: message poison, redelivery count 0, after " in failed[0]
    assert failed[0].rstrip().endswith("RuntimeError: poison message 2")
    assert len([line for line in output.splitlines() if "port Work stopped" in line]) == 1, \
        "one line per state change"
    assert "fine" not in output


def _formatted(formatter: logging.Formatter, message: str, *args: Any) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(MaskingFilter())
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"test.mask.{id(formatter)}")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        try:
            raise ConnectionError("could not reach amqp://app:s3cret@rabbit:5672// (password=hunter2)")
        except ConnectionError:
            logger.exception(message, *args)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_no_secret_reaches_a_log_line(formatter: logging.Formatter) -> None:
    out = _formatted(formatter, "connect %s with password=%s failed", "postgresql://u:pg-secret@db/x",
                     "topsecret")
    for secret in ("s3cret", "hunter2", "pg-secret", "topsecret"):
        assert secret not in out, out
    assert "amqp://app:***@rabbit" in out and "postgresql://u:***@db/x" in out
    assert "password=***" in out


# -- mdb ports --watch ----------------------------------------------------------------------------


# The drawing is the CLI's; the queue depths it shows come through the wire's queue status, which
# QueueProbe.count reads on both backends in every behaviour test.
@on_embedded
def test_watch_draws_states_rates_failures_and_backlog(backend: Backend) -> None:
    queue, other = backend.q("ORDERS"), backend.q("AUDIT")
    settings = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 20}, "Bean": {"destination": other}},
        queues={queue: {}, other: {}},
    )
    with backend.producer(settings) as producer:
        producer.send(other, {"n": 0, "action": "fail"}, message_id="poison")
        producer.send(other, {"n": 1}, message_id="waiting")
    with backend.container(settings).start(wait=False) as container:
        wait_for(lambda: (container.port_state("Bean") or {}).get("state") == "stopped",
                 what="Bean to stop")
        result = mdb("ports", "--watch", "--iterations", "2", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "mdb ports --watch" in out and "msg/s" in out and "backlog" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("container "))
    assert header.split()[:4] == ["container", "port", "queue", "state"], header
    at = lines.index(next(line for line in lines if f" {other} " in line))
    bean, below = lines[at], lines[at + 1]
    assert "stopped" in bean and "…" not in out
    assert "maximum retries (0) exceeded" in bean + below, "the reason whole, beside or under its row"
    end = header.index("backlog") + len("backlog")  # numbers are right-aligned under their header
    assert bean[:end].split()[-1] == "2", "the poison message and the one behind it wait"
    work = next(line for line in out.splitlines() if f" {queue} " in line)
    assert "started" in work
    assert f"backout queues: {backend.q('DLQ')} 0" in out


# Ctrl-C and the option check are the CLI's, whatever the transport.
@on_embedded
def test_watch_exits_0_on_ctrl_c_and_refuses_json(backend: Backend) -> None:
    settings = backend.write(ports={"Work": {"destination": backend.q("Q")}})
    # Started with SIGINT ignored, as a non-interactive shell starts a background job (and as some
    # test workers pass it on): the watch must hear Ctrl-C all the same.
    watcher = subprocess.Popen(
        [sys.executable, "-m", "mdbcontainer", "ports", "--watch", "-c", str(settings)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, **backend.env},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        time.sleep(8)  # importing and the first sample take a few seconds on a loaded machine
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=20)
    finally:
        if watcher.poll() is None:  # not left running into the next test
            watcher.kill()
            watcher.communicate()
    assert watcher.returncode == 0, err
    assert "no running containers" in out
    result = mdb("ports", "--watch", "--json", settings=settings, env=backend.env)
    assert result.returncode == 2 and "--watch" in result.stderr


# -- the probes' rules, on the objects they read ----------------------------------------------------


def _consumer(index: int = 0, *, alive: bool = True, consuming: bool = True, idle_for: float = 0.0,
              delivering: bool = False) -> Any:
    import threading
    from types import SimpleNamespace

    thread = threading.Thread(target=lambda: None)
    if not alive:
        thread.start()
        thread.join()
    else:
        thread = threading.current_thread()
    now = time.monotonic()
    return SimpleNamespace(index=index, thread=thread, consuming=consuming, alive_at=now - idle_for,
                           delivering_since=now - idle_for if delivering else None)


def _container(consumers: list[Any], *, state: str = "started", reason: str = "",
               stopping: bool = False, autostart: bool = True, outages: dict[str, Any] | None = None) -> Any:
    from types import SimpleNamespace

    port = SimpleNamespace(consumers=consumers, stopping=stopping, state=state, reason=reason,
                           settings=SimpleNamespace(autostart=autostart),
                           stuck=lambda now=None: [])  # handler_timeout off
    resources = SimpleNamespace(shutting_down=False, outage_report=lambda: outages or {})
    return SimpleNamespace(ports={"Work": port}, threads=[], resources=resources)


def test_liveness_fails_only_for_a_dead_or_wedged_consumer() -> None:
    from mdbcontainer.runtime.endpoints import WEDGED_AFTER, liveness

    assert liveness(_container([_consumer()])) == []
    assert liveness(_container([_consumer(idle_for=WEDGED_AFTER + 5, delivering=True)])) == [], \
        "a long delivery is not wedged"
    assert liveness(_container([_consumer(idle_for=WEDGED_AFTER + 5, consuming=False)])) == [], \
        "reconnecting during an outage is not wedged"
    assert liveness(_container([_consumer(idle_for=WEDGED_AFTER + 5, consuming=False)],
                               outages={"broker": (70.0, "ConnectionRefusedError")})) == []
    wedged = liveness(_container([_consumer(1, idle_for=WEDGED_AFTER + 5)]))
    assert len(wedged) == 1 and wedged[0].startswith("port Work consumer 1: wedged: no drain loop for")
    assert liveness(_container([_consumer(alive=False)])) == [
        "port Work consumer 0: thread died while the port should run"]
    assert liveness(_container([_consumer(alive=False)], stopping=True)) == [], "a stopped port's threads end"


def test_readiness_counts_ports_stopped_as_configured_as_ready() -> None:
    from mdbcontainer.runtime.endpoints import STOPPED_BY_OPERATOR, readiness

    assert readiness(_container([], state="stopped", reason=STOPPED_BY_OPERATOR)) == []
    assert readiness(_container([], state="stopped", autostart=False)) == []
    assert readiness(_container([_consumer()], state="stopped", reason="starting")) == [
        "port Work stopped: starting"]
    assert readiness(_container([], state="stopped", reason="maximum retries (0) exceeded",
                                stopping=True)) == ["port Work stopped: maximum retries (0) exceeded"]
    assert readiness(_container([_consumer()], outages={"database": (12.4, "OperationalError: gone")})) == [
        "database unavailable for 12s: OperationalError: gone"]


# -- mdb ports: the table says what --json says ------------------------------------------------------


# The table and --json are drawn from the same rows on either database; dedup itself runs on both
# backends in tests/behaviour/test_once_only.py.
@on_embedded
def test_ports_table_agrees_with_json_and_shows_a_skipped_duplicate(backend: Backend) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": queue, "accept": ["application/json"]}})
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1}, message_id="twice")
        producer.send(queue, {"n": 1}, message_id="twice")  # a producer's duplicate
        producer.send(queue, "plain words", message_id="not-json")  # invalid body: backed out
    with backend.container(settings) as container:
        def counts() -> tuple[Any, Any]:
            row = container.port_state("Work") or {}
            return row.get("duplicate_skipped"), row.get("invalid_body")

        wait_for(lambda: counts() == (1, 1), what="one handled, one duplicate, one invalid body")
        [row] = json.loads(mdb("ports", "--json", settings=settings, env=backend.env).stdout)
        wide = mdb("ports", settings=settings, env={**backend.env, "COLUMNS": "250"})
        narrow = mdb("ports", settings=settings, env={**backend.env, "COLUMNS": "80"})
        log = container.output()
    assert (row["handled"], row["duplicate_skipped"], row["backed_out"], row["invalid_body"]) == (1, 1, 0, 1)

    header, line, outbox = wide.stdout.splitlines()  # the table, then the outbox's line
    assert outbox == "outbox: no sends waiting", wide.stdout
    columns = ["delivered", "handled", "duplicate", "failed", "backed out", "invalid body", "expired"]
    fields = ["delivered", "handled", "duplicate_skipped", "failed", "backed_out", "invalid_body",
              "expired"]
    for column, field in zip(columns, fields, strict=True):
        end = header.index(column) + len(column)  # numbers are right-aligned under their header
        assert line[:end].split()[-1] == str(row[field]), (column, wide.stdout)

    lines = narrow.stdout.splitlines()
    assert all(len(text) <= 80 for text in lines), narrow.stdout
    assert "handled" in lines[0] and "duplicate" in lines[0], "the dedup step is visible in 80 columns"
    assert lines[0].startswith("container ") and lines[1].startswith(row["container"])
    assert "…" not in narrow.stdout and "batches" not in narrow.stdout, "empty: left out, nothing cut"

    skipped = [text for text in log.splitlines() if "duplicate_skipped" in text]
    assert len(skipped) == 1, log
    assert "port Work: duplicate_skipped: message twice" in skipped[0]
    assert " INFO " in skipped[0]


# -- the database pool is sized from the ports' concurrency --------------------------------------


def test_forty_consumers_holding_their_sessions_at_once_never_wait_on_the_pool(rabbit: Backend) -> None:
    """Each handler holds its session until all 40 hold theirs (tests/apps/crowd.py): a pool
    smaller than the consumers would time them out as "database unavailable" and turn /readyz 503."""
    queue, consumers = rabbit.q("CROWD"), 40
    port = free_port()
    settings = rabbit.write(ports={"Crowd": {"destination": queue, "concurrency": consumers,
                                             "prefetch": 1}}, queues={queue: {}}, metrics_port=port)
    container = ContainerProcess(settings, env={**rabbit.env, "MDB_TEST_CROWD": str(consumers)}, cwd=ROOT)
    with container.start(timeout=90):
        with rabbit.producer(settings) as producer:
            for n in range(consumers):
                producer.send(queue, {"n": n}, message_id=f"crowd-{n}")
        readyz: set[int] = set()

        def done() -> bool:
            readyz.add(probe(port, "/readyz")[0])
            assert "database unavailable" not in container.output(), container.output()[-3000:]
            return len(rabbit.effects("Crowd")) == consumers

        wait_for(done, timeout=60, interval=0.25, what="every message handled")
    assert rabbit.effects("Crowd") == {f"crowd-{n}": 1 for n in range(consumers)}
    assert readyz == {200}
    assert "database unavailable" not in container.output()


# -- handler_timeout: a hung handler is seen ---------------------------------------------------


# The handler_timeout watchdog and /healthz are the process's own; no broker or database decides them.
@on_embedded
def test_a_handler_past_handler_timeout_fails_healthz_shows_stuck_and_warns_once(
        backend: Backend) -> None:
    queue = backend.q("HUNG")
    port = free_port()
    settings = backend.write(ports={"Work": {"destination": queue, "handler_timeout": "2s"}},
                             queues={queue: {}}, metrics_port=port)
    with backend.container(settings) as container:
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "sleep", "seconds": 0.5}, message_id="slow-ok")
        wait_for(lambda: backend.effects("Work"), what="a handler within its timeout")
        assert probe(port, "/healthz")[0] == 200
        with backend.producer(settings) as producer:
            # Hung until the checks below are done: it waits for the file ``go`` (at most 60 s).
            reached, go = backend.tmp / "hung-reached", backend.tmp / "hung-go"
            producer.send(queue, {"n": 2, "pause": [str(reached), str(go)]}, message_id="hung-1")
        wait_for(lambda: probe(port, "/healthz")[0] == 503, timeout=7, what="/healthz to fail")
        status, body = probe(port, "/healthz")
        assert status == 503 and body["status"] == "not alive", body
        assert len(body["reasons"]) == 1, body
        assert body["reasons"][0].startswith("port Work consumer 0: handler stuck for "), body
        assert "on message hung-1 (handler_timeout 2s)" in body["reasons"][0], body
        assert probe(port, "/readyz")[0] == 200, "stuck is a liveness failure, not readiness"

        def stuck_rows() -> list[dict[str, Any]]:
            result = mdb("ports", "--json", settings=settings, env=backend.env)
            rows = [r for r in json.loads(result.stdout) if r["port"] == "Work" and r["stuck"]]
            return rows

        rows = wait_for(stuck_rows, timeout=5, what="mdb ports to show the consumer stuck")
        assert rows[0]["state"] == "started"
        assert rows[0]["stuck"][0]["consumer"] == 0
        assert rows[0]["stuck"][0]["message_ids"] == ["hung-1"]
        table = mdb("ports", settings=settings, env=backend.env).stdout
        assert " stuck " in table.splitlines()[1] + " ", table
        assert "Work stuck: consumer 0 in its handler for" in table and "message hung-1" in table
        go.touch()
        wait_for(lambda: probe(port, "/healthz")[0] == 200, timeout=10, what="/healthz back")
        wait_for(lambda: backend.effects("Work")["hung-1"] == 1, what="the hung message handled")
        warnings = [line for line in container.output().splitlines()
                    if "WARNING" in line and "handler stuck" in line]
        assert len(warnings) == 1, warnings
        assert "port Work consumer 0: handler stuck for" in warnings[0]
        assert "message hung-1" in warnings[0]
