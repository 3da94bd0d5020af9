"""Tracing (README "Tracing"), as a user's collector sees it.

The suite runs an OTLP/HTTP receiver on 127.0.0.1: it decodes the
``ExportTraceServiceRequest`` messages the exporters of real ``mdb run`` and
``mdb send`` processes post, so each assertion is about what a tracing
backend would show: span names, kinds, parents, links and attributes.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from mdbcontainer.testing import ContainerProcess, headers_of, mdb, wait_for
from tests.conftest import ROOT, Backend, on_embedded, one_line_error

pytestmark = pytest.mark.slow

PRODUCER, CONSUMER = 4, 5  # opentelemetry-proto's Span.SpanKind


@dataclass
class Span:
    """One span as the collector received it."""

    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    service: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)
    status: int = 0


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class Collector:
    """An OTLP/HTTP trace receiver: what the exporters posted, decoded, and a GET to call."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.gets = 0
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                request = ExportTraceServiceRequest()
                request.ParseFromString(data)
                collector.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def do_GET(self) -> None:  # the traced handler's HTTP call
                with collector._lock:
                    collector.gets += 1
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(Span(
                        name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent=s.parent_span_id.hex(), service=str(resource.get("service.name")),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        status=s.status.code,
                    ))
        with self._lock:
            self.spans.extend(received)

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def one(self, name: str, **attributes: Any) -> Span | None:
        found = [s for s in self.named(name)
                 if all(s.attributes.get(k) == v for k, v in attributes.items())]
        return found[0] if len(found) == 1 else None

    def children(self, parent: Span) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.parent == parent.span_id and s.trace_id == parent.trace_id]

    def env(self, service: str) -> dict[str, str]:
        """What a process needs to trace to this collector, the standard OTEL_* way."""
        return {
            "MDB_CONTAINER__TRACING": "true",
            "OTEL_SERVICE_NAME": service,
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.close()


def send(backend: Backend, collector: Collector, settings: Path, queue: str, body: str,
         *args: str) -> list[str]:
    """``mdb send`` with tracing on; the ids it printed."""
    done = mdb("send", queue, body, *args, settings=settings, env={**backend.env, **collector.env("cli")},
               cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def container(backend: Backend, collector: Collector, settings: Path, service: str = "orders",
              **env: str) -> ContainerProcess:
    return ContainerProcess(settings, env={**backend.env, **collector.env(service), **env}, cwd=ROOT)


def test_one_trace_runs_from_mdb_send_through_two_ports_and_an_outbox_send(
        backend: Backend, collector: Collector) -> None:
    orders, shipping = backend.q("ORDERS"), backend.q("SHIPPING")
    settings = backend.write(ports={"Traced": {"destination": orders},
                                    "Downstream": {"destination": shipping}},
                             queues={orders: {}, shipping: {}})
    with container(backend, collector, settings, MDB_TEST_HTTP=f"{collector.url}/stock"):
        [sent] = send(backend, collector, settings, orders, f'{{"n": 1, "action": "send", "to": "{shipping}"}}')
        done = wait_for(lambda: collector.one(f"process {shipping}"), what="the downstream process span")
        process = wait_for(lambda: collector.one(f"process {orders}"), what="the handler's process span")
        wait_for(lambda: any(s.kind == 3 for s in collector.children(process)), what="the HTTP span")

    publish = collector.one(f"publish {orders}")
    relay = collector.one(f"publish {shipping}")
    assert publish is not None and relay is not None
    assert (publish.service, process.service, done.service) == ("cli", "orders", "orders")
    assert publish.kind == PRODUCER and publish.parent == "", "mdb send starts the trace"
    assert publish.attributes["messaging.message.id"] == sent
    assert publish.attributes["messaging.destination.name"] == orders
    assert publish.attributes["messaging.operation.type"] == "send"
    assert publish.attributes["messaging.system"] == "rabbitmq"

    assert process.kind == CONSUMER and process.parent == publish.span_id
    assert {s.trace_id for s in (publish, process, relay, done)} == {publish.trace_id}, "one trace"
    assert process.attributes == {
        "messaging.system": "rabbitmq", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.destination.name": orders,
        "messaging.rabbitmq.destination.routing_key": orders, "messaging.message.id": sent,
        "messaging.message.body.size": process.attributes["messaging.message.body.size"],
        "mdb.port": "Traced", "mdb.redelivery_count": 0, "mdb.outcome": "handled",
    }
    assert process.attributes["messaging.message.body.size"] > 20

    children = collector.children(process)
    kinds = sorted((s.kind, s.name.split()[0]) for s in children)
    assert (3, "GET") in kinds, f"the httpx call is a child of the process span: {kinds}"
    assert any(s.attributes.get("db.system") or s.attributes.get("db.system.name") for s in children), \
        f"the handler's SQL is a child of the process span: {[s.name for s in children]}"
    assert relay in children and relay.kind == PRODUCER, "the outbox send is published under it"
    assert relay.attributes["messaging.message.id"] == f"{sent}.out"
    assert done.parent == relay.span_id and done.attributes["mdb.port"] == "Downstream"
    assert done.attributes["mdb.outcome"] == "handled"


def test_a_backout_shows_each_failure_and_the_move_in_the_message_trace(
        backend: Backend, collector: Collector) -> None:
    orders = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": orders, "max_retries": 5}},
                             queues={orders: {"backout_threshold": 2}})
    with container(backend, collector, settings) as c:
        send(backend, collector, settings, orders, '{"n": 7, "action": "fail"}', "--id", "poison")
        wait_for(lambda: (c.port_state("Work") or {}).get("backed_out") == 1, what="the backout")
        move = wait_for(lambda: collector.one(f"publish {backend.q('DLQ')}"), what="the move's span")
        wait_for(lambda: len(collector.named(f"process {orders}")) == 2, what="two process spans")
    shown = mdb("dlq", "show", "poison", "--json", settings=settings, env=backend.env, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    [entry] = json.loads(shown.stdout)
    headers = entry["headers"]

    publish = collector.one(f"publish {orders}")
    assert publish is not None
    first, second = sorted(collector.named(f"process {orders}"),
                           key=lambda s: s.attributes["mdb.redelivery_count"])
    for span in (first, second):
        assert span.parent == publish.span_id and span.trace_id == publish.trace_id
        assert span.attributes["error.type"] == "RuntimeError" and span.status == 2  # ERROR
    assert (first.attributes["mdb.outcome"], first.attributes["mdb.redelivery_count"]) == ("failed", 0)
    assert (second.attributes["mdb.outcome"], second.attributes["mdb.redelivery_count"]) == ("backed_out", 1)
    assert move.parent == second.span_id and move.kind == PRODUCER
    assert move.attributes["messaging.message.id"] == "poison"
    assert headers["traceparent"].split("-")[1:3] == [publish.trace_id, move.span_id], \
        "the backed-out copy names the move's span"
    assert headers["x-mdb-backout-reason"] == "backout-threshold", "the other headers are kept"

    replayed = mdb("dlq", "replay", "poison", settings=settings, cwd=ROOT,
                   env={**backend.env, **collector.env("cli")})
    assert replayed.returncode == 0, replayed.stderr
    replay = wait_for(lambda: [s for s in collector.named(f"publish {orders}") if s.parent],
                      what="the replay's span")[0]
    assert (replay.trace_id, replay.parent) == (publish.trace_id, move.span_id), \
        "a replay joins the trace the message was backed out of"
    [again] = backend.probe(settings).take_all(orders)
    assert headers_of(again)["traceparent"].split("-")[1:3] == [publish.trace_id, replay.span_id]


# The spans of a batch are drawn by the container from the headers both transports carry alike
# (the end-to-end trace above runs on both).
@on_embedded
def test_a_batch_is_one_process_span_linked_to_each_message(backend: Backend, collector: Collector) -> None:
    queue = backend.q("BATCH")
    settings = backend.write(ports={"BatchWork": {"destination": queue, "batch_size": 5,
                                                  "batch_linger": "5s"}},
                             queues={queue: {}})
    with container(backend, collector, settings, MDB_TEST_BATCHES=str(backend.tmp / "batches.log")):
        ids = send(backend, collector, settings, queue, '{"n": 1}', "--count", "5", "--id", "b")
        batch = wait_for(lambda: collector.one(f"process {queue}"), what="the batch's span")
    publishes = {s.attributes["messaging.message.id"]: s for s in collector.named(f"publish {queue}")}
    assert sorted(publishes) == sorted(ids) == [f"b-{n}" for n in range(1, 6)]
    assert batch.kind == CONSUMER and batch.parent == ""
    assert batch.attributes["messaging.batch.message_count"] == 5
    assert batch.attributes["mdb.outcome"] == "handled" and batch.attributes["mdb.port"] == "BatchWork"
    assert sorted(batch.links) == sorted((s.trace_id, s.span_id) for s in publishes.values())
    assert len(collector.named(f"process {queue}")) == 1, "one span for the batch, none per message"


# The spans of a fallback are the pipeline's; the headers they read cross both transports alike
# (the end-to-end trace and the backout's trace run on both).
@on_embedded
def test_a_batch_that_falls_back_shows_its_failure_and_each_message_alone(
        backend: Backend, collector: Collector) -> None:
    queue = backend.q("BATCH")
    settings = backend.write(ports={"BatchWork": {"destination": queue, "batch_size": 3,
                                                  "batch_linger": "20s", "max_retries": 5}},
                             queues={queue: {"backout_threshold": 1}})
    with container(backend, collector, settings, MDB_TEST_BATCHES=str(backend.tmp / "batches.log")):
        for name, action in (("a", "ok"), ("poison", "fail"), ("c", "ok")):
            send(backend, collector, settings, queue, f'{{"n": 1, "action": "{action}"}}', "--id", name)
        wait_for(lambda: len(collector.named(f"process {queue}")) == 4, what="the batch and 3 alone")
    publishes = {s.attributes["messaging.message.id"]: s for s in collector.named(f"publish {queue}")}
    [batch] = [s for s in collector.named(f"process {queue}") if "messaging.batch.message_count" in s.attributes]
    assert batch.attributes["error.type"] == "RuntimeError" and batch.status == 2
    assert batch.attributes["mdb.outcome"] == "failed" and len(batch.links) == 3
    alone = {s.attributes["messaging.message.id"]: s for s in collector.named(f"process {queue}")
             if s is not batch}
    assert sorted(alone) == ["a", "c", "poison"]
    for name, span in alone.items():
        assert (span.trace_id, span.parent) == (publishes[name].trace_id, publishes[name].span_id), \
            "run alone, each message is processed in its own trace"
    assert [alone[n].attributes["mdb.outcome"] for n in ("a", "poison", "c")] == \
        ["handled", "backed_out", "handled"]
    assert alone["poison"].attributes["error.type"] == "RuntimeError"


def test_a_send_relayed_after_a_crash_stays_in_the_handlers_trace(
        backend: Backend, collector: Collector) -> None:
    orders, shipping = backend.q("ORDERS"), backend.q("SHIPPING")
    settings = backend.write(ports={"Traced": {"destination": orders},
                                    "Downstream": {"destination": shipping}},
                             queues={orders: {}, shipping: {}}, outbox_relay_grace="1s")
    spans = backend.tmp / "spans.log"
    crashing = container(backend, collector, settings, MDB_CRASH_AT="after-commit",
                         MDB_TEST_SPANS=str(spans), MDB_CRASH_ONCE_FILE=str(backend.tmp / "crashed"))
    with crashing:
        [sent] = send(backend, collector, settings, orders, f'{{"n": 1, "action": "send", "to": "{shipping}"}}')
        assert crashing.wait_exit(60) == -9, "killed between the commit and the outbox publish"
    _, trace_id, handler_span = spans.read_text().split()
    with container(backend, collector, settings, MDB_TEST_SPANS=str(spans)):
        done = wait_for(lambda: collector.one(f"process {shipping}"), timeout=40,
                        what="the relayed message's process span")
    publish = collector.one(f"publish {orders}")
    relay = collector.one(f"publish {shipping}")
    assert publish is not None and relay is not None
    assert publish.trace_id == trace_id, "the handler ran in the producer's trace"
    assert relay.trace_id == trace_id and relay.parent == handler_span, \
        "the relay published the row under the handler's span, though that process was killed"
    assert relay.attributes["messaging.message.id"] == f"{sent}.out"
    assert done.trace_id == trace_id and done.parent == relay.span_id


# A row without a context starts a trace of its own: the relay's choice, not the database's (the
# row with a context, relayed after a crash, runs on both backends).
@on_embedded
def test_a_row_left_with_tracing_off_is_relayed_with_tracing_on_in_a_trace_of_its_own(
        backend: Backend, collector: Collector) -> None:
    """Turning tracing on keeps the outbox working: a row without a context starts a new trace."""
    orders, shipping = backend.q("ORDERS"), backend.q("SHIPPING")
    settings = backend.write(ports={"Work": {"destination": orders},
                                    "Downstream": {"destination": shipping}},
                             queues={orders: {}, shipping: {}}, outbox_relay_grace="1s")
    untraced = {**backend.env, "MDB_CRASH_AT": "after-commit",
                "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")}
    crashing = ContainerProcess(settings, env=untraced, cwd=ROOT)
    with crashing, backend.producer(settings) as producer:
        producer.send(orders, {"n": 1, "action": "send", "to": shipping}, message_id="old")
        assert crashing.wait_exit(60) == -9
    with container(backend, collector, settings):
        done = wait_for(lambda: collector.one(f"process {shipping}"), timeout=40,
                        what="the relayed message's process span")
    relay = collector.one(f"publish {shipping}")
    assert relay is not None and relay.parent == "" and relay.attributes["messaging.message.id"] == "old.out"
    assert done.parent == relay.span_id and done.attributes["mdb.outcome"] == "handled"


# Which modules load is the process's, whatever the transport.
@on_embedded
def test_tracing_off_imports_no_opentelemetry(backend: Backend, tmp_path: Path) -> None:
    """A publish and a delivery with tracing off load no module of opentelemetry."""
    queue = backend.q("PLAIN")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    script = f"""
import sys, threading
from mdbcontainer.runtime.container import Container
from mdbcontainer.sending.producer import Producer
from mdbcontainer.settings import load_settings
from mdbcontainer.testing import wait_for
settings = load_settings({str(settings)!r})
container = Container(settings)
container.start()
with Producer(settings) as producer:
    producer.send({queue!r}, {{"n": 1}})
wait_for(lambda: container.ports["Work"].stats.handled == 1)
container.stop()
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
print(loaded)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90,
                          cwd=ROOT, env={**os.environ, **backend.env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_tracing_on_without_the_extra_is_a_one_line_error(tmp_path: Path) -> None:
    backend = Backend("embedded", tmp_path)  # the error comes before any connection
    queue = backend.q("PLAIN")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    missing = tmp_path / "site"
    (missing / "opentelemetry").mkdir(parents=True)
    (missing / "opentelemetry" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'opentelemetry'\", name='opentelemetry')\n")
    env = {**backend.env, "PYTHONPATH": f"{missing}{os.pathsep}{ROOT}", "MDB_CONTAINER__TRACING": "true"}
    for command in (["send", queue, "{}"], ["run"], ["check"]):
        line = one_line_error(mdb(*command, settings=settings, env=env, cwd=ROOT), code=2)
        assert "container.tracing" in line and "mdbcontainer[otel]" in line, line


def test_a_message_with_a_broken_traceparent_is_handled_in_a_new_trace(
        backend: Backend, collector: Collector) -> None:
    queue = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with container(backend, collector, settings) as c:
        with backend.producer(settings) as producer:  # tracing off here: the headers go as given
            producer.send(queue, {"n": 1}, message_id="broken",
                          headers={"traceparent": "00-not-a-context-01", "tracestate": 7})
        span = wait_for(lambda: collector.one(f"process {queue}"), what="the process span")
        wait_for(lambda: (c.port_state("Work") or {}).get("handled") == 1, what="handled")
    assert span.parent == "" and span.attributes["mdb.outcome"] == "handled"
    assert span.attributes["messaging.message.id"] == "broken"
