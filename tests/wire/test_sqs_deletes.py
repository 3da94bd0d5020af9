"""SQS acknowledgments (wire/sqs.py ``flush_deletes``): batched, and kept when SQS is out of reach.

An acknowledged message is deleted with the next receive or visibility round.
A flush that meets SQS out of reach for a moment keeps what it did not send,
so the next flush deletes it: otherwise every message acknowledged in that
moment would be delivered again when its visibility timeout ends.
"""

from __future__ import annotations

import time

import kombu
import pytest

from mdbcontainer.wire.sqs import KombuTransport, sqs_name
from tests.chaos.faults import forwarded
from tests.conftest import Backend


def test_acknowledgments_a_flush_could_not_send_are_sent_by_the_next(
        sqs: Backend, moto_sqs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    queue = sqs.q("ACKS")
    client = sqs.sqs_client()
    url = client.create_queue(QueueName=sqs_name(queue), Attributes={"VisibilityTimeout": "2"})["QueueUrl"]
    for n in range(3):
        client.send_message(QueueUrl=url, MessageBody=f'{{"n": {n}}}')
    with forwarded(moto_sqs) as forwarder:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{forwarder.port}")
        with kombu.Connection(hostname="sqs", transport=KombuTransport,
                              transport_options={"connect_timeout": 2}) as connection:
            channel = connection.default_channel
            messages = [channel.basic_get(queue) for _ in range(3)]
            assert all(m is not None for m in messages)
            for message in messages:
                channel.basic_ack(message.delivery_tag)  # three: kept for the next flush
            forwarder.stop()
            with pytest.raises(ConnectionError):
                channel.flush_deletes()
            forwarder.start()
            channel.flush_deletes()
            time.sleep(3.0)  # past the visibility timeout: an undeleted message is back
            attributes = client.get_queue_attributes(QueueUrl=url, AttributeNames=[
                "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert attributes == {"ApproximateNumberOfMessages": "0", "ApproximateNumberOfMessagesNotVisible": "0"}
