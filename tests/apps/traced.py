"""Port ``Traced``: a handler with instrumented libraries, for tests/test_tracing.py.

On its first delivery it instruments the container's SQLAlchemy engine (its
session's) and httpx, as an application would; then per delivery it does the
work of ``common.perform`` (a row, a send) and, when ``$MDB_TEST_HTTP`` names
a URL, one HTTP GET. The span the handler runs in is appended to
``$MDB_TEST_SPANS`` (message id, trace id, span id), so a test can find it
even when the process is killed before the span is exported.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace

from mdbcontainer import Message, MessageContext, message_driven

from .common import perform

_instrumented: set[int] = set()


def _instrument(engine: Any) -> None:
    if id(engine) in _instrumented:
        return
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    # The instrumentation declares SQLAlchemy < 2.1 and refuses 2.1 unless told: it works with it.
    SQLAlchemyInstrumentor().instrument(engine=engine, skip_dep_check=True)
    if not _instrumented:
        HTTPXClientInstrumentor().instrument()
    _instrumented.add(id(engine))


def _note_span(message: Message) -> None:
    path = os.environ.get("MDB_TEST_SPANS")
    if path:
        context = trace.get_current_span().get_span_context()
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{message.id}\t{context.trace_id:032x}\t{context.span_id:016x}\n")


@message_driven("Traced", transaction="container")
def traced(message: Message, ctx: MessageContext) -> None:
    _instrument(ctx.session.get_bind())
    _note_span(message)
    url = os.environ.get("MDB_TEST_HTTP")
    if url:
        import httpx

        httpx.get(url, timeout=10).raise_for_status()
    perform("Traced", message, ctx, ctx.session)
