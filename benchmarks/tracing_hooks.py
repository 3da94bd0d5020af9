"""CPU cost of the tracing hooks per delivery, in process: tracing off, and on with the SDK.

What the pipeline calls for one delivery of a ``transaction = "none"`` port
(the ``process`` span: start, redelivery count, outcome, end) and what a
publish adds (a ``publish`` span and its ``traceparent``), timed in CPU time
so the machine's other load moves it less than a wall-clock rate. Tracing on
uses a ``BatchSpanProcessor`` whose exporter encodes each batch as OTLP
protobuf (what the OTLP exporter posts) and drops it; its thread's CPU is
counted too (process CPU time). See benchmarks/README.md.

    .venv/bin/python benchmarks/tracing_hooks.py [--n 200000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdbcontainer.support.tracing import OFF, Tracing


class FakeDelivery:
    """What a process span reads of a delivery, as a producer with tracing on sends it."""

    def __init__(self) -> None:
        self.headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        self.properties = {"message_id": "0f8fad5bd9cb469fa16570867728950e", "headers": self.headers}
        self.body = b'{"n": 1}'
        self.routing_key = "orders"


def per_delivery(tracing: Tracing, n: int, publish: bool) -> tuple[float, float]:
    """(thread CPU, process CPU) microseconds per delivery."""
    port = tracing.for_port("OrdersPort", "orders")
    delivery = FakeDelivery()
    props: dict[str, Any] = {"message_id": "x", "headers": {}}
    thread0, process0 = time.thread_time(), time.process_time()
    for _ in range(n):
        span = port.process(delivery)
        port.counted(0)
        if publish:
            with tracing.publishing("", "shipping", b"{}", props) as traced:
                assert traced
        tracing.outcome("handled")
        span.end()
    thread = (time.thread_time() - thread0) / n * 1e6
    if tracing.enabled:
        tracing.provider.force_flush()  # type: ignore[attr-defined]  # the export thread's share
    return thread, (time.process_time() - process0) / n * 1e6


def otel() -> Tracing:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from mdbcontainer.support import spans

    class Encoding(SpanExporter):
        def export(self, batch: Sequence[ReadableSpan]) -> SpanExportResult:
            encode_spans(batch).SerializeToString()
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Encoding(), max_queue_size=1_000_000))  # drop none
    trace.set_tracer_provider(provider)
    return spans.configured()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    args = parser.parse_args()
    print(f"{'tracing':<8}{'per delivery':<22}{'consumer us':>12}{'process us':>12}")
    on = otel()
    for name, tracing in (("off", OFF), ("on", on)):
        for publish in (False, True):
            n = args.n if name == "off" else args.n // 10
            thread, process = per_delivery(tracing, n, publish)
            what = "process + 1 publish" if publish else "process span"
            print(f"{name:<8}{what:<22}{thread:>12.2f}{process:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
