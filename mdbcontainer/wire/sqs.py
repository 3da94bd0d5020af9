"""Amazon SQS (``sqs://``) through boto3: a kombu virtual channel whose every call is an SQS request.

kombu's own SQS transport is not used: it keeps no message attributes
(headers, our ids), cannot change a message's visibility (the redelivery
delay, a long handler) and reads no receive count. This channel speaks boto3
and gives the wire what every transport gives it:

- a queue the settings name is created (``CreateQueue``; a ``.fifo`` name
  makes a FIFO queue); SQS allows letters, digits, ``-`` and ``_`` only, so
  other characters of a name become ``_`` (``SYSTEM.DEAD.LETTER.QUEUE`` is
  ``SYSTEM_DEAD_LETTER_QUEUE`` on SQS; :func:`sqs_name`);
- a publish is ``SendMessage``: its answer is the confirm. The body is the
  message's text (base64, said in an attribute, when it is not UTF-8);
  headers are message attributes, one each, and the AMQP properties are
  attributes too: ``message_id`` (the producer's id, not SQS's own),
  ``content_type``, ``content_encoding`` and, for the rest, one JSON
  attribute ``mdb-properties``. SQS takes at most ten attributes: headers
  past that ride together in one JSON attribute ``mdb-headers``;
- a delivery is a received message, ``redelivered`` when SQS's
  ``ApproximateReceiveCount`` is above one; acks are ``DeleteMessageBatch``
  (sent before the next receive, :meth:`Channel.flush_deletes`), a
  requeue and a hand-back set its visibility to 0 (graceful stop included),
  a redelivery delay sets it to the delay (:meth:`Channel.postpone`: kept by
  SQS, so it survives a crash); and while a message is held (its handler
  runs, or it waits in the prefetch) its visibility is extended every third
  of the queue's visibility timeout, so a long handler's message never
  reaches a second consumer mid-way;
- a FIFO queue's message group is the ``JMSXGroupID`` header (published
  with it, delivered with it); a message without one is in group ``default``.
  The deduplication id is the message id.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import re
import threading
import uuid
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping
from queue import Empty
from typing import TYPE_CHECKING, Any

import kombu
from amqp.exceptions import AccessRefused, ChannelError
from kombu.transport import virtual
from kombu.utils import json as kombu_json

from ..embedded.errors import BASIC_RETURN, QUEUE_DECLARE, NoRoute, not_found
from .transport import Capabilities, Transport, settled_tags

if TYPE_CHECKING:
    from ..settings import PortSettings, Settings

log = logging.getLogger("mdbcontainer.broker")

SQS_CAPS = Capabilities(
    "sqs", publisher_confirms=False, redelivered_flag=True, channel_transactions=False,
    exclusive_queues=False, heartbeats=False, postpones=True, topics=False, priorities=False,
    replies=False, partitions=False, strict_redeclare=False,
)

#: Header of a FIFO queue's message group (JMS's message group, as ordered ports read it).
GROUP_HEADER = "JMSXGroupID"
DEFAULT_GROUP = "default"
MAX_ATTRIBUTES = 10  # SQS's own limit per message
MAX_VISIBILITY = 43200  # 12 hours: SQS's limit
# Attributes that carry the AMQP properties, not a header.
_ID, _TYPE, _ENCODING, _PROPS, _HEADERS, _BODY = (
    "message_id", "content_type", "content_encoding", "mdb-properties", "mdb-headers",
    "mdb-body-encoding")
_RESERVED = frozenset({_ID, _TYPE, _ENCODING, _PROPS, _HEADERS, _BODY})
_PROPERTY_KEYS = ("correlation_id", "reply_to", "timestamp", "delivery_mode", "priority",
                  "expiration", "type", "app_id", "user_id")
_ATTRIBUTE_NAME = re.compile(r"^(?!\.)(?!.*\.\.)(?!(?i:aws\.|amazon\.))[A-Za-z0-9_.-]{1,256}(?<!\.)$")
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]")


def sqs_name(queue: str) -> str:
    """The SQS name of queue ``queue``: characters SQS refuses become ``_`` (``.fifo`` is kept)."""
    base, suffix = (queue[:-5], ".fifo") if queue.endswith(".fifo") else (queue, "")
    return _NOT_IN_NAME.sub("_", base)[: 80 - len(suffix)] + suffix


def _value(value: Any) -> dict[str, str]:
    """One message attribute value: String, Number, or JSON text for anything else."""
    if isinstance(value, str) and value:
        return {"DataType": "String", "StringValue": value}
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"DataType": "Number", "StringValue": repr(value)}
    return {"DataType": "String.json", "StringValue": kombu_json.dumps(value)}


def _read(attribute: Mapping[str, Any]) -> Any:
    kind = str(attribute.get("DataType", "String"))
    text = attribute.get("StringValue")
    if text is None:
        return attribute.get("BinaryValue")
    if kind == "String.json":
        return kombu_json.loads(text)
    if kind.startswith("Number"):
        try:
            return int(text)
        except ValueError:
            return float(text)
    return text


def to_sqs(payload: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A kombu payload as an SQS body and message attributes (see the module's docstring)."""
    body = payload.get("body") or b""
    attrs: dict[str, Any] = {}
    if isinstance(body, bytes):
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = base64.b64encode(body).decode("ascii")
            attrs[_BODY] = _value("base64")
    else:
        text = str(body)
    properties = payload.get("properties") or {}
    if properties.get("message_id"):
        attrs[_ID] = _value(str(properties["message_id"]))
    if payload.get("content-type"):
        attrs[_TYPE] = _value(payload["content-type"])
    if payload.get("content-encoding"):
        attrs[_ENCODING] = _value(payload["content-encoding"])
    rest = {k: properties[k] for k in _PROPERTY_KEYS if properties.get(k) not in (None, "")}
    if rest.get("priority") == 0:
        del rest["priority"]
    if rest:
        attrs[_PROPS] = _value(rest)
    headers = dict(payload.get("headers") or {})
    overflow: dict[str, Any] = {}
    for name in sorted(headers, key=str):
        if len(attrs) < MAX_ATTRIBUTES and _ATTRIBUTE_NAME.match(str(name)) and name not in _RESERVED:
            attrs[str(name)] = _value(headers[name])
        else:
            overflow[str(name)] = headers[name]
    if overflow:
        if len(attrs) >= MAX_ATTRIBUTES:  # make room: the last header joins the overflow
            last = next(k for k in reversed(attrs) if k not in _RESERVED)
            overflow[last] = headers[last]
            del attrs[last]
        attrs[_HEADERS] = _value(overflow)
    return text, attrs


def from_sqs(message: Mapping[str, Any], queue: str, tag: str) -> dict[str, Any]:
    """An SQS message as the kombu payload the wire reads (headers, properties, delivery info)."""
    attrs = {k: _read(v) for k, v in (message.get("MessageAttributes") or {}).items()}
    system = message.get("Attributes") or {}
    text = message.get("Body") or ""
    body = base64.b64decode(text) if attrs.get(_BODY) == "base64" else text.encode("utf-8")
    headers = {k: v for k, v in attrs.items() if k not in _RESERVED}
    more = attrs.get(_HEADERS)
    if isinstance(more, dict):
        headers.update(more)
    group = system.get("MessageGroupId")
    if group and GROUP_HEADER not in headers:
        headers[GROUP_HEADER] = group
    properties: dict[str, Any] = {}
    extra = attrs.get(_PROPS)
    if isinstance(extra, dict):
        properties.update(extra)
    if attrs.get(_ID) is not None:
        properties["message_id"] = str(attrs[_ID])
    if "timestamp" not in properties and system.get("SentTimestamp"):
        with contextlib.suppress(TypeError, ValueError):
            properties["timestamp"] = int(system["SentTimestamp"]) // 1000
    try:
        received = int(system.get("ApproximateReceiveCount", 1))
    except (TypeError, ValueError):
        received = 1
    properties.update(
        delivery_tag=tag, body_encoding=None,
        delivery_info={"exchange": "", "routing_key": queue, "redelivered": received > 1},
    )
    return {
        "body": body,
        "content-type": attrs.get(_TYPE) or "text/plain",
        "content-encoding": attrs.get(_ENCODING) or None,
        "headers": headers,
        "properties": properties,
    }


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """boto3's network and login errors as the wire's: a lost connection, a refused login."""
    from botocore import exceptions as boto

    try:
        yield
    except (boto.EndpointConnectionError, boto.ConnectionClosedError, boto.ConnectTimeoutError,
            boto.ReadTimeoutError, boto.HTTPClientError) as exc:
        raise ConnectionError(f"SQS not reachable: {exc}") from exc
    except boto.NoCredentialsError as exc:
        raise AccessRefused(f"SQS: {exc} (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from exc
    except boto.NoRegionError as exc:
        raise AccessRefused(f"SQS: {exc} (AWS_DEFAULT_REGION)") from exc
    except boto.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("InvalidClientTokenId", "SignatureDoesNotMatch", "AccessDenied",
                    "AccessDeniedException", "UnrecognizedClientException"):
            raise AccessRefused(f"SQS refused the login: {code}") from exc
        raise


def _missing(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    code = exc.response.get("Error", {}).get("Code", "")
    return code in ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist")


#: A consumer's idle read (``ListenerPort.idle_read``, half a second) long-polls: with short
#: polls an idle consumer asked SQS for messages some twenty times a second (each request
#: billed; on moto, a saturated server under a suite's load). A long poll answers as soon as a
#: message arrives, so a delivery waits no longer; an idle read takes up to a second instead
#: of half of one (a graceful stop, the liveness check's drain loop: both allow more).
LONG_POLL_FROM = 0.5


class Channel(virtual.Channel):  # type: ignore[misc]
    """A kombu channel on SQS (see the module's docstring)."""

    body_encoding = None
    do_restore = True

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self._client = connection.sqs
        self.events: defaultdict[str, set[Any]] = defaultdict(set)  # basic_return, as py-amqp
        self._urls: dict[str, str] = {}
        self._visibility: dict[str, int] = {}
        self._held: dict[str, tuple[str, str, str]] = {}  # delivery tag -> (queue, url, receipt)
        self._groups: dict[str, str] = {}  # delivery tag -> message group, on FIFO queues
        # Acknowledged, to delete: one DeleteMessageBatch for up to ten, before the next receive.
        self._deletes: dict[str, list[str]] = {}  # queue URL -> receipt handles
        self._buffer: dict[str, deque[dict[str, Any]]] = {}
        self._wait_seconds = 1
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None

    @property
    def sqs(self) -> Any:
        """The connection's boto3 client (kept: kombu unsets ``connection`` as a channel closes)."""
        return self._client

    # -- queues -----------------------------------------------------------

    def url(self, queue: str) -> str:
        """The queue's URL (one GetQueueUrl per channel and queue); raises when it does not exist."""
        found = self._urls.get(queue)
        if found is None:
            with _translated():
                found = str(self.sqs.get_queue_url(QueueName=sqs_name(queue))["QueueUrl"])
            self._urls[queue] = found
        return found

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        if queue in self._urls:
            return
        try:
            self.url(queue)
            return
        except Exception as exc:
            if not _missing(exc):
                raise
        attributes = {"FifoQueue": "true"} if queue.endswith(".fifo") else {}
        with _translated():
            self._urls[queue] = str(self.sqs.create_queue(
                QueueName=sqs_name(queue), Attributes=attributes)["QueueUrl"])

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        try:
            self.url(queue)
        except Exception as exc:
            if _missing(exc):
                return False
            raise
        return True

    def _attribute(self, queue: str, name: str) -> str:
        with _translated():
            answer = self.sqs.get_queue_attributes(QueueUrl=self.url(queue), AttributeNames=[name])
        return str(answer.get("Attributes", {}).get(name, "0"))

    def _size(self, queue: str) -> int:
        return int(self._attribute(queue, "ApproximateNumberOfMessages"))

    def visibility(self, queue: str) -> int:
        """The queue's visibility timeout in seconds (read once per channel)."""
        seconds = self._visibility.get(queue)
        if seconds is None:
            seconds = self._visibility[queue] = max(1, int(self._attribute(queue, "VisibilityTimeout")))
        return seconds

    def _purge(self, queue: str) -> int:
        size = self._size(queue)
        with _translated():
            self.sqs.purge_queue(QueueUrl=self.url(queue))
        return size

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        with _translated():
            self.sqs.delete_queue(QueueUrl=self.url(queue))
        self._urls.pop(queue, None)

    def queue_declare(self, queue: str | None = None, passive: bool = False, **kwargs: Any) -> Any:
        """A passive declare of a missing queue is AMQP's NOT_FOUND, as on the other transports."""
        if passive and queue and not self._has_queue(queue):
            raise not_found("queue", queue, QUEUE_DECLARE)
        return super().queue_declare(queue=queue, passive=passive, **kwargs)

    def queue_bind(self, *args: Any, **kwargs: Any) -> None:
        raise ChannelError("SQS has no exchanges or bindings: topics are refused at start")

    # -- publish ----------------------------------------------------------

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> None:
        """SendMessage: confirmed by its answer. A queue that does not exist is unroutable."""
        if exchange:
            raise ChannelError(f"SQS has no exchanges: cannot publish to {exchange!r}")
        try:
            url = self.url(routing_key)
        except Exception as exc:
            if not _missing(exc):
                raise
            self._returned(message, routing_key, kwargs.get("mandatory", False))
            return
        text, attributes = to_sqs(message)
        request: dict[str, Any] = {"QueueUrl": url, "MessageBody": text}
        if attributes:
            request["MessageAttributes"] = attributes
        if routing_key.endswith(".fifo"):
            headers = message.get("headers") or {}
            request["MessageGroupId"] = str(headers.get(GROUP_HEADER) or DEFAULT_GROUP)
            request["MessageDeduplicationId"] = str(
                (message.get("properties") or {}).get("message_id") or uuid.uuid4().hex)[:128]
        with _translated():
            self.sqs.send_message(**request)

    def _returned(self, message: dict[str, Any], queue: str, mandatory: bool) -> None:
        if not mandatory:
            return
        exc = NoRoute("NO_ROUTE", BASIC_RETURN, reply_code=312)
        handlers = self.events.get("basic_return")
        if not handlers:
            raise exc
        message.setdefault("properties", {}).setdefault("delivery_tag", uuid.uuid4().hex)
        message["properties"].setdefault("delivery_info", {})
        returned = self.Message(message, channel=self)
        for handler in list(handlers):
            handler(exc, "", queue, returned)

    # -- receive ----------------------------------------------------------

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> Any:
        # Long polling (a second) when the caller waits at least LONG_POLL_FROM; a short poll
        # otherwise (a batch's linger, the test kit's short reads).
        self._wait_seconds = 1 if timeout is None or timeout >= LONG_POLL_FROM else 0
        return super().drain_events(timeout=timeout, callback=callback)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        buffered = self._buffer.get(queue)
        if buffered:
            payload: dict[str, Any] = buffered.popleft()
            return payload
        self.flush_deletes()
        room = self.qos.can_consume_max_estimate()
        wanted = max(1, min(10, room if room else 10))
        url = self.url(queue)
        with _translated():
            answer = self.sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=wanted, WaitTimeSeconds=self._wait_seconds,
                MessageAttributeNames=["All"], AttributeNames=["All"])
        received = answer.get("Messages") or []
        if not received:
            raise Empty()
        self._keep_visible(queue)
        payloads: deque[dict[str, Any]] = deque()
        with self._lock:
            for message in received:
                tag = uuid.uuid4().hex
                self._held[tag] = (queue, url, message["ReceiptHandle"])
                group = (message.get("Attributes") or {}).get("MessageGroupId")
                if group:
                    self._groups[tag] = group
                payloads.append(from_sqs(message, queue, tag))
        first = payloads.popleft()
        if payloads:
            self._buffer.setdefault(queue, deque()).extend(payloads)
        return first

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        try:
            payload = self._get(queue)
        except Empty:
            return None
        message = self.Message(payload, channel=self)
        if no_ack:
            self._settle([message.delivery_tag], delete=True)
        else:
            self.qos.append(message, message.delivery_tag)
        return message

    # -- settle -----------------------------------------------------------

    def _tags(self, delivery_tag: Any, multiple: bool) -> list[Any]:
        tags = settled_tags(self.qos, delivery_tag, multiple)
        for tag in tags:
            self._forget(tag)
        return tags

    def _forget(self, delivery_tag: Any) -> None:
        """kombu's own bookkeeping of a settled tag (its virtual channel's ``basic_ack``: the
        QoS forgets it); what SQS hears is :meth:`_settle`'s."""
        super().basic_ack(delivery_tag)

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        self._settle(self._tags(delivery_tag, multiple), delete=True)

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        self._settle(self._tags(delivery_tag, False), delete=not requeue)

    def basic_nack(self, delivery_tag: Any, multiple: bool = False, requeue: bool = True) -> None:
        self._settle(self._tags(delivery_tag, multiple), delete=not requeue)

    def postpone(self, delivery_tag: Any, seconds: float) -> None:
        """The message becomes visible again in ``seconds`` (SQS keeps the wait); settled here."""
        self._forget(delivery_tag)
        self._settle([delivery_tag], delete=False, visibility=round(seconds))

    def _restore(self, message: Any) -> None:
        """Hand back (close, graceful stop): visible again at once."""
        self._settle([message.delivery_tag], delete=False)

    def _restore_at_beginning(self, message: Any) -> None:
        self._restore(message)

    def _settle(self, tags: list[Any], *, delete: bool, visibility: int = 0) -> None:
        """Delete the messages of ``tags``, or set their visibility (0: back at once)."""
        by_url: dict[str, list[tuple[str, str]]] = {}
        with self._lock:
            if not delete:
                tags = [*tags, *self._behind(tags)]
            for tag in tags:
                self._groups.pop(tag, None)
                held = self._held.pop(tag, None)
                if held is not None:
                    by_url.setdefault(held[1], []).append((str(tag), held[2]))
        if delete:
            with self._lock:
                for url, entries in by_url.items():
                    self._deletes.setdefault(url, []).extend(r for _, r in entries)
                full = any(len(receipts) >= 10 for receipts in self._deletes.values())
            if full:
                self.flush_deletes()
            return
        for url, entries in by_url.items():
            for start in range(0, len(entries), 10):
                with _translated():
                    self._change(url, entries[start:start + 10], min(MAX_VISIBILITY, max(0, visibility)))

    def flush_deletes(self) -> None:
        """Delete what was acknowledged (DeleteMessageBatch, ten at a time).

        An acknowledgment is sent with the next receive, when ten are waiting, at
        the next visibility round and at close, so a message the pipeline settled
        can come back only after a crash, as one whose ack was lost: the dedup
        table absorbs it on a once-only port.
        """
        with self._lock:
            deletes, self._deletes = self._deletes, {}
        for url, receipts in deletes.items():
            for start in range(0, len(receipts), 10):
                chunk = receipts[start:start + 10]
                try:
                    with _translated():
                        if len(chunk) == 1:
                            self.sqs.delete_message(QueueUrl=url, ReceiptHandle=chunk[0])
                        else:
                            self.sqs.delete_message_batch(QueueUrl=url, Entries=[
                                {"Id": str(i), "ReceiptHandle": r} for i, r in enumerate(chunk)])
                except Exception:
                    # Kept for the next flush: SQS out of reach for a moment must not turn every
                    # acknowledgment of the moment into a redelivery once the visibility ends.
                    self._keep_deletes(deletes, url, start)
                    raise

    def _keep_deletes(self, deletes: dict[str, list[str]], url: str, start: int) -> None:
        """Put back what a failed flush did not send: ``url``'s receipts from ``start``, and the rest."""
        with self._lock:
            urls = list(deletes)
            for other in urls[urls.index(url):]:
                unsent = deletes[other][start:] if other == url else deletes[other]
                self._deletes.setdefault(other, []).extend(unsent)

    def _behind(self, tags: list[Any]) -> list[str]:
        """The prefetched messages of the groups of FIFO messages going back: they go back too.

        SQS delivers a group's next messages only while none before them is in
        flight; a message handed back or postponed must not be overtaken by the
        later ones of its group this channel already received.
        """
        groups = {(self._held[t][0], self._groups[t]) for t in tags if t in self._groups and t in self._held}
        behind: list[str] = []
        for queue, group in groups:
            buffered = self._buffer.get(queue)
            if not buffered:
                continue
            keep: deque[dict[str, Any]] = deque()
            for payload in buffered:
                tag = payload["properties"]["delivery_tag"]
                if self._groups.get(tag) == group:
                    behind.append(tag)
                else:
                    keep.append(payload)
            self._buffer[queue] = keep
        return behind

    def _change(self, url: str, entries: list[tuple[str, str]], seconds: int) -> None:
        if len(entries) == 1:
            try:
                self.sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=entries[0][1],
                                                   VisibilityTimeout=seconds)
            except Exception as exc:  # deleted meanwhile, or its receipt expired: SQS has it again
                log.debug("SQS: visibility of a message not changed: %s", exc)
            return
        self.sqs.change_message_visibility_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": r, "VisibilityTimeout": seconds}
            for i, (_, r) in enumerate(entries)])

    # -- long handlers: the visibility of held messages is extended --------------

    def _keep_visible(self, queue: str) -> None:
        self.visibility(queue)  # read now, on the consumer's thread
        if self._keeper is None:
            self._keeper = threading.Thread(target=self._keep, name="mdb-sqs-visibility", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        """Every third of the shortest visibility timeout, extend every held message's by a whole one."""
        while not self._stop.wait(max(0.5, min(self._visibility.values(), default=30) / 3)):
            try:
                self.flush_deletes()
            except Exception as exc:  # the consumer's next receive tries again
                log.debug("SQS: acknowledgments not sent: %s", exc)
            # Under the lock throughout: a message settled meanwhile (handed back at visibility 0)
            # must not be made invisible again by an extension that read it before.
            with self._lock:
                if self._stop.is_set():
                    return
                by_url: dict[tuple[str, str], list[tuple[str, str]]] = {}
                for queue, url, receipt in self._held.values():
                    by_url.setdefault((queue, url), []).append(("", receipt))
                for (queue, url), entries in by_url.items():
                    for start in range(0, len(entries), 10):
                        try:
                            self._change(url, entries[start:start + 10], self._visibility.get(queue, 30))
                        except Exception as exc:  # the next round tries again
                            log.debug("SQS: visibility not extended: %s", exc)

    def close(self) -> None:
        """Hand back what is held (graceful stop: visibility 0), prefetched messages included."""
        self._stop.set()
        with self._lock:  # an extension under way ends first
            pass
        try:
            self.flush_deletes()
        except Exception as exc:  # not deleted: delivered again after their visibility timeout
            log.warning("SQS: %d acknowledgments not sent at close: %s",
                        sum(map(len, self._deletes.values())), exc)
        try:
            super().close()
        finally:
            with self._lock:
                rest = list(self._held)
            if rest:
                with contextlib.suppress(Exception):  # not handed back: visible after their timeout
                    self._settle(rest, delete=False)
            self._buffer.clear()


class KombuTransport(virtual.Transport):  # type: ignore[misc]
    """kombu's side: a boto3 SQS client per connection."""

    Channel = Channel
    polling_interval = 0.05  # after a short poll came back empty; a long poll waits itself
    driver_type = "sqs"
    driver_name = "boto3"
    connection_errors = (*virtual.Transport.connection_errors, ConnectionError)
    channel_errors = (*virtual.Transport.channel_errors,)
    implements = virtual.Transport.implements.extend(asynchronous=False, heartbeats=False,
                                                     exchange_type=frozenset(["direct"]))

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.sqs: Any = None

    def establish_connection(self) -> Any:
        """A boto3 client from the AWS environment, and one request to see that SQS answers."""
        import boto3
        from botocore.config import Config

        for name in ("boto3", "botocore"):  # their INFO lines (credentials found, ...) say nothing to us
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        options = self.client.transport_options
        config = Config(connect_timeout=float(options.get("connect_timeout", 10)), read_timeout=30,
                        retries={"max_attempts": 2, "mode": "standard"})
        with _translated():
            self.sqs = boto3.session.Session().client("sqs", config=config)
            self.sqs.list_queues(MaxResults=1)
        return super().establish_connection()

    def driver_version(self) -> str:
        import boto3

        return str(boto3.__version__)


class SQSTransport(Transport):
    """``sqs://``: region, credentials and endpoint from the AWS environment."""

    schemes = ("sqs",)
    capabilities = SQS_CAPS

    def connection(self, url: str, *, confirms: bool, heartbeat: int, timeout: float,
                   polling_interval: float | None) -> kombu.Connection:
        return kombu.Connection(hostname="sqs", transport=KombuTransport,
                                transport_options={"connect_timeout": timeout})

    def implied_order_key(self, destination: str | None) -> str | None:
        """A FIFO queue's message group keys its port (CONTRACT section 17), as ``order_by`` would.

        SQS keeps a group's order only between receives: one receive hands out
        several messages of a group, which an async port's tasks (or an ordered
        port's lanes) would otherwise run side by side.
        """
        return GROUP_HEADER if destination and destination.endswith(".fifo") else None

    def refusals(self, settings: Settings, ports: Mapping[str, PortSettings]) -> list[str]:
        out = super().refusals(settings, ports)
        for port, p in ports.items():
            if p.acknowledge == "transacted":
                out.append(f"ports.{port}.acknowledge: 'transacted' needs channel transactions, "
                           "which sqs has not")
        return out
