"""Bad input, fuzzed: whatever bytes, content types and headers arrive, nothing crashes.

Two levels: a fast property test of the decode path (thousands of inputs,
in-process), and batches of hostile messages drawn by hypothesis sent through
a real broker to a real ``mdb run``, which must back each out with a reason
that names the problem, keep its port started and handle the good messages
around them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import kombu
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdbcontainer.handlers.registry import Invoker, import_listeners
from mdbcontainer.message import MAX_JSON_DEPTH, InvalidBody
from mdbcontainer.testing import wait_for
from mdbcontainer.wire.delivery import Delivery, envelope
from tests.conftest import Backend, RawMessage

ACCEPT = ["application/json", "text/plain"]
MAX_BYTES = 4096

content_types = st.one_of(
    st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8",
                     "application/x-python-serialize", "application/octet-stream", "", "TEXT/PLAIN",
                     "application/x-yaml", "application/msgpack"]),
    st.text(max_size=30),
)
nested = st.integers(1, 200).map(lambda depth: ("[" * depth + "]" * depth).encode())
bodies = st.one_of(
    st.binary(max_size=300), nested, st.text(max_size=200).map(str.encode),
    st.integers(1, 50).map(lambda extra: b'"' + b"x" * (MAX_BYTES + extra) + b'"'),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
)
header_values = st.one_of(st.text(max_size=20), st.integers(-(2**31), 2**31 - 1), st.booleans(), st.none())


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies, ctype=content_types,
       headers=st.dictionaries(st.sampled_from(["x-mdb-redelivery-count", "x-delivery-count", "x-mdb-port", "h"]),
                               header_values, max_size=3),
       priority=st.one_of(st.none(), st.integers(-5, 300), st.text(max_size=3)),
       timestamp=st.one_of(st.none(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=4)),
       expiration=st.one_of(st.none(), st.text(max_size=6)))
def test_decode_path_only_ever_says_invalid_body(body: bytes, ctype: str, headers: dict[str, Any],
                                                 priority: Any, timestamp: Any, expiration: Any) -> None:
    raw = RawMessage(body, ctype, headers, {"priority": priority, "timestamp": timestamp,
                                            "expiration": expiration})
    invoker = Invoker.for_spec(import_listeners(["tests.apps.typed"])["Typed"])
    try:
        message = envelope(Delivery(raw), "id", 0, ACCEPT, MAX_BYTES, "Q")
        invoker.argument(message)
    except InvalidBody as exc:
        text = str(exc)
        assert text and "\n" not in text
        if len(body) > MAX_BYTES:
            assert "max_message_bytes" in text
        return
    assert len(body) <= MAX_BYTES
    assert 0 <= message.priority <= 255


def test_deep_nesting_is_refused_before_parsing() -> None:
    raw = RawMessage(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "application/json")
    with pytest.raises(InvalidBody, match="nested deeper"):
        envelope(Delivery(raw), "id", 0, ACCEPT, 10**6, "Q")


hostile = st.tuples(st.one_of(st.binary(min_size=1, max_size=100), nested,
                              st.integers(1, 9).map(lambda extra: b"{" * (MAX_BYTES + extra))),
                    content_types, st.dictionaries(st.sampled_from(["x-mdb-redelivery-count", "x-mdb-backout-reason", "x-delivery-count"]),
                                                   st.one_of(st.text(max_size=5), st.integers(-100, 100)), max_size=2))


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(hostile, min_size=15, max_size=25))
def test_hostile_messages_are_backed_out_and_the_port_keeps_running(backend: Backend, batch: list[Any]) -> None:
    example = uuid.uuid4().hex[:8]  # hypothesis runs several examples on one backend
    queue, dlq = backend.q(f"FUZZ-{example}"), backend.q(f"DLQ-{example}")
    settings_path = backend.write(
        ports={"Work": {"destination": queue, "max_retries": 0, "max_message_bytes": MAX_BYTES,
                        "transaction": "none"}},
        dead_letter_queue=dlq,
    )
    probe = backend.probe(settings_path)
    sent_bad: list[str] = []
    with backend.container(settings_path) as container:
        conn = probe.broker.connect()
        try:
            producer = kombu.Producer(conn.channel())
            for index, (body, ctype, headers) in enumerate(batch):
                decodable = _decodes(body, ctype)
                mid = f"{'good' if decodable else 'bad'}-{index}"
                producer.publish(body, routing_key=queue, exchange="", content_type=ctype or None,
                                 content_encoding="binary", headers=headers, message_id=mid,
                                 serializer=None, delivery_mode=2)
                if not decodable:
                    sent_bad.append(mid)
                producer.publish(json.dumps({"n": index}).encode(), routing_key=queue, exchange="",
                                 content_type="application/json", content_encoding="utf-8",
                                 message_id=f"ok-{index}", delivery_mode=2)
        finally:
            conn.close()
        wait_for(lambda: len({a[1] for a in backend.attempts() if a[1].startswith("ok-")}) == len(batch),
                 timeout=60, what="every good message")
        wait_for(lambda: probe.count(dlq) >= len(sent_bad), timeout=30, what="every backout")
        state = container.port_state("Work")
        assert state["state"] == "started", state
        assert container.alive()
    dead = {m.properties["message_id"]: dict(m.headers or {}) for m in probe.take_all(dlq)}
    assert set(sent_bad) <= set(dead)
    for mid in sent_bad:
        assert dead[mid]["x-mdb-backout-reason"] == "invalid-body"
        assert dead[mid]["x-mdb-exception"].startswith("InvalidBody: ")
        assert isinstance(dead[mid]["x-mdb-redelivery-count"], int), "forged headers are replaced"


def _decodes(body: bytes, ctype: str) -> bool:
    try:
        envelope(Delivery(RawMessage(body, ctype)), "x", 0, ACCEPT, MAX_BYTES, "Q")
    except InvalidBody:
        return False
    return True
