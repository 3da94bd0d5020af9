"""How a message looks on SQS (wire/sqs.py): what a producer in another language sends and reads."""

from __future__ import annotations

from typing import Any

from mdbcontainer.wire.sqs import MAX_ATTRIBUTES, from_sqs, sqs_name, to_sqs


def payload(body: bytes, headers: dict[str, Any], **properties: Any) -> dict[str, Any]:
    return {"body": body, "content-type": "application/json", "content-encoding": "utf-8",
            "headers": headers, "properties": {"message_id": "m-1", **properties}}


def received(text: str, attributes: dict[str, Any], count: int = 1) -> dict[str, Any]:
    return {"Body": text, "MessageAttributes": attributes, "ReceiptHandle": "r",
            "Attributes": {"ApproximateReceiveCount": str(count), "SentTimestamp": "1700000000123"}}


def test_headers_and_the_producers_id_are_attributes_and_come_back_as_they_were() -> None:
    headers = {"tenant": "acme", "attempt": 3, "ratio": 0.5, "tags": ["a", "b"], "empty": ""}
    text, attributes = to_sqs(payload(b'{"n": 1}', headers, correlation_id="c-9"))
    assert text == '{"n": 1}'
    assert attributes["message_id"] == {"DataType": "String", "StringValue": "m-1"}
    assert attributes["tenant"] == {"DataType": "String", "StringValue": "acme"}
    assert attributes["attempt"]["DataType"] == "Number"
    back = from_sqs(received(text, attributes), "ORDERS", "tag-1")
    assert back["headers"] == headers
    assert back["properties"]["message_id"] == "m-1"
    assert back["properties"]["correlation_id"] == "c-9"
    assert back["content-type"] == "application/json"
    assert back["properties"]["delivery_info"] == {"exchange": "", "routing_key": "ORDERS",
                                                   "redelivered": False}


def test_more_headers_than_sqs_takes_ride_together_and_none_is_lost() -> None:
    headers = {f"h{i:02d}": f"v{i}" for i in range(15)}
    text, attributes = to_sqs(payload(b"{}", headers))
    assert len(attributes) <= MAX_ATTRIBUTES
    assert from_sqs(received(text, attributes), "Q", "t")["headers"] == headers


def test_a_binary_body_is_base64_and_comes_back_as_bytes() -> None:
    body = bytes(range(256))
    text, attributes = to_sqs(payload(body, {}))
    assert from_sqs(received(text, attributes), "Q", "t")["body"] == body


def test_a_second_receive_is_a_redelivery_and_the_sent_time_is_the_timestamp() -> None:
    back = from_sqs(received("x", {}, count=2), "Q", "t")
    assert back["properties"]["delivery_info"]["redelivered"] is True
    assert back["properties"]["timestamp"] == 1700000000
    assert back["content-type"] == "text/plain", "a bare SQS message is text"


def test_a_plain_message_from_another_producer_reads_as_headers() -> None:
    attributes = {"message_id": {"DataType": "String", "StringValue": "ext-1"},
                  "source": {"DataType": "String", "StringValue": "billing"}}
    back = from_sqs(received('{"a": 1}', attributes), "Q", "t")
    assert back["properties"]["message_id"] == "ext-1"
    assert back["headers"] == {"source": "billing"}


def test_queue_names_keep_what_sqs_allows_and_their_fifo_suffix() -> None:
    assert sqs_name("SYSTEM.DEAD.LETTER.QUEUE") == "SYSTEM_DEAD_LETTER_QUEUE"
    assert sqs_name("orders-eu_1") == "orders-eu_1"
    assert sqs_name("PAYMENTS.fifo") == "PAYMENTS.fifo"
    assert len(sqs_name("x" * 100 + ".fifo")) == 80
