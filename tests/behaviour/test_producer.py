"""Sending from outside a handler: ``Producer`` and ``mdb send`` as a user calls them."""

from __future__ import annotations

import inspect

import kombu
import pytest
from amqp.exceptions import NotFound

from mdbcontainer import Producer, RequestTimeout, Unroutable
from mdbcontainer.message import InvalidBody, decode_body
from mdbcontainer.settings import Settings
from mdbcontainer.support.outgoing import outgoing
from mdbcontainer.testing import mdb
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.delivery import Delivery
from tests.conftest import RABBITMQ_URL, Backend, one_line_error


def queue_exists(settings: Settings, name: str) -> bool:
    """A passive declare: the broker's own answer, not a count that reads 0 for a missing queue."""
    conn = Broker(settings).connect()
    try:
        conn.channel().queue_declare(queue=name, passive=True)
    except NotFound:
        return False
    finally:
        conn.close()
    return True


# -- a queue publish is mandatory on every broker (README: Sending from Python) --------------


def test_send_to_a_queue_nobody_named_exits_1_naming_it_and_creates_nothing(backend: Backend) -> None:
    typo = backend.q("NO.SUCH.QUEUE")
    path = backend.write(ports={"Work": {"destination": backend.q("WORK")}})
    result = mdb("send", typo, '{"a": 1}', "-c", str(path), env=backend.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    line = one_line_error(result)
    assert f"queue {typo!r} does not exist" in line
    assert not queue_exists(backend.settings(path), typo)


def test_producer_send_to_a_missing_queue_raises_unroutable(transport: Backend) -> None:
    typo = transport.q("MISSING")
    path = transport.write(ports={"Work": {"destination": transport.q("WORK")}})
    with transport.producer(path) as producer, pytest.raises(Unroutable, match=typo):
        producer.send(typo, {"a": 1})
    assert not queue_exists(transport.settings(path), typo)


def test_a_queue_the_settings_name_is_declared_by_the_first_send(backend: Backend) -> None:
    """A port's destination and a [queues] table are declared before the publish, as the container does."""
    work, table = backend.q("WORK"), backend.q("TABLE")
    path = backend.write(ports={"Work": {"destination": work}}, queues={table: {"max_priority": 9}})
    for queue in (work, table):
        result = mdb("send", queue, '{"a": 1}', "-c", str(path), env=backend.env)
        assert result.returncode == 0, result.stderr
        assert backend.probe(path).count(queue) == 1


# -- Producer's keywords, bytes and content types --------------------------------------------


def test_send_labels_text_and_bytes_with_their_content_type(backend: Backend) -> None:
    queue = backend.q("TYPED")
    path = backend.write(ports={"Work": {"destination": queue}})
    png = bytes(range(256))  # not UTF-8: sent and received as it is
    with backend.producer(path) as producer:
        producer.send(queue, "<order id='1'/>", content_type="application/xml", message_id="xml")
        producer.send(queue, png, content_type="image/png", message_id="png", priority=7,
                      headers={"x-source": "scanner"}, ttl="5m", persistent=False)
    xml, image = map(Delivery, backend.probe(path).take_all(queue))
    assert (xml.message_id, xml.content_type, xml.body) == ("xml", "application/xml", b"<order id='1'/>")
    assert (image.message_id, image.content_type, image.body) == ("png", "image/png", png)
    assert image.properties["priority"] == 7 and image.headers["x-source"] == "scanner"
    assert image.properties["delivery_mode"] == 1 and image.properties["expiration"] == "300000"


def test_request_passes_its_keywords_on_to_the_request(backend: Backend) -> None:
    queue = backend.q("UNANSWERED")
    path = backend.write(ports={"Work": {"destination": queue}})
    with backend.producer(path) as producer, pytest.raises(RequestTimeout):
        producer.request(queue, b"\x00\x01", timeout="300ms", content_type="application/octet-stream",
                         headers={"h": "v"}, priority=9, message_id="ask", correlation_id="c-1")
    [request] = map(Delivery, backend.probe(path).take_all(queue))
    assert request.message_id == "ask" and request.properties["correlation_id"] == "c-1"
    assert request.properties["reply_to"], "sent with its temporary reply queue"
    assert (request.content_type, request.body) == ("application/octet-stream", b"\x00\x01")
    assert request.headers["h"] == "v" and request.properties["priority"] == 9


def test_bad_bodies_and_keywords_are_refused_naming_the_public_argument() -> None:
    with pytest.raises(TypeError, match="a bytes body needs a content_type"):
        outgoing("Q", b"raw")
    with pytest.raises(TypeError, match="content_type 'text/csv' needs a str or bytes body"):
        outgoing("Q", {"a": 1}, content_type="text/csv")
    producer = Producer.__new__(Producer)  # no broker needed: the call fails on its arguments
    with pytest.raises(TypeError, match=r"send\(\) got an unexpected keyword argument 'colour'"):
        producer.send("Q", {}, colour="red")  # type: ignore[call-arg]


def test_send_request_and_reply_spell_the_same_keywords() -> None:
    """Typed keywords, not ``**options``: an IDE and mypy see them; ``ctx.send`` is the reference."""
    from mdbcontainer import MessageContext

    def keywords(function: object) -> set[str]:
        params = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        assert all(p.kind is not p.VAR_KEYWORD for p in params), function
        return {p.name for p in params if p.kind is p.KEYWORD_ONLY}

    reference = keywords(MessageContext.send)
    assert reference == {"priority", "ttl", "persistent", "headers", "message_id", "reply_to",
                         "correlation_id", "content_type"}
    assert keywords(Producer.send) == reference
    assert keywords(Producer.request) == reference - {"reply_to"} | {"timeout"}
    assert keywords(MessageContext.reply) == reference - {"reply_to"}


def test_an_accepted_binary_type_reaches_the_handler_as_bytes() -> None:
    """A port that accepts ``image/png`` gets the bytes as sent; text and JSON stay decoded."""
    accept = ["image/png", "application/json", "text/plain"]
    assert decode_body(b"\x89PNG\xff", "image/png", accept, 100, "binary") == b"\x89PNG\xff"
    assert decode_body(b'{"a":1}', "application/json", accept, 100, "binary") == {"a": 1}
    assert decode_body(b"words", "text/plain", accept, 100, "binary") == "words"
    with pytest.raises(InvalidBody, match="not accepted"):
        decode_body(b"\x89PNG", "image/png", ["application/json"], 100, "binary")


@pytest.mark.rabbitmq
def test_a_queue_deleted_under_a_long_lived_producer_is_declared_again(rabbit: Backend) -> None:
    """A publisher declares each destination once. After the queue is deleted (an operator,
    ``rabbitmqctl delete_queue``), a mandatory publish returns: that one fails, and the
    next must declare the queue again instead of failing for the life of the publisher
    (the outbox relay would retry the row for ever)."""
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
