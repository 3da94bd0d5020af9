"""Settings models: what the TOML file may say, each key typed and checked.

The models mirror the file: ``[container]``, ``[console]``, ``[queues.NAME]``,
``[topics.NAME]`` and ``[ports.NAME]``. Unknown keys are errors (a typo must
not be silently ignored); reading the file and the environment, and putting an
error in one line, is ``loading.py``'s work.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .durations import Duration
from .urls import broker_url_problem, database_url_problem, mask_url, remember_password

# The transports whose capabilities wire/connection.py declares. memory:// is not among them: no
# behaviour test ran on it, and it does not flag redeliveries, which the counting relies on.
BROKER_SCHEMES = frozenset({"amqp", "amqps", "pyamqp", "embedded", "sqs"})

_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# The container durations that must be at least a second, and why (the settings error says it).
_WHY_A_SECOND = {
    "database_timeout": "database connections, keepalives and open transactions are bounded by it",
    "outbox_relay_grace": ("a younger outbox row may be one its consumer is publishing now, "
                           "and the relay would send it twice"),
}
# Where an overridden key came from: its key path -> the environment variable that set it.
Overrides = dict[tuple[str, ...], str]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ContainerSettings(_Strict):
    """``[container]``: what the whole process shares."""

    broker_url: str = "embedded://.mdb/broker.db"
    database_url: str = "sqlite:///.mdb/container.db"
    listeners: list[str] = Field(default_factory=list)
    # "module:attribute" of the application's SQLAlchemy MetaData (or declarative Base):
    # its missing tables are created at start (development; production migrates).
    metadata: str | None = None
    dead_letter_queue: str = "SYSTEM.DEAD.LETTER.QUEUE"
    dedup_retention: Duration = timedelta(days=7)
    shutdown_timeout: Duration = timedelta(seconds=30)
    connect_timeout: Duration = timedelta(seconds=10)
    heartbeat: Duration = timedelta(seconds=30)
    database_timeout: Duration = timedelta(seconds=30)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"  # all interfaces: a Kubernetes probe comes from outside the pod
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    table_prefix: str = Field(default="mdb_", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    db_schema: str | None = None
    control_interval: Duration = timedelta(seconds=1)
    # A send left in the outbox by a crash is relayed once it is this old: a younger
    # row may be the one its consumer is publishing right now (a second copy).
    outbox_relay_grace: Duration = timedelta(seconds=5)
    # How often the outbox relay sweeps for sends (on PostgreSQL it is also told at each commit).
    outbox_relay_interval: Duration = timedelta(seconds=1)
    # Container processes of one ``mdb run`` (a supervisor runs them when > 1: supervisor.py).
    processes: int = Field(default=1, ge=1, le=64)
    ssl_ca: str | None = None
    ssl_cert: str | None = None
    ssl_key: str | None = None
    # OpenTelemetry spans, set up from the OTEL_* variables (the otel extra; README "Tracing").
    tracing: bool = False

    @field_validator("broker_url")
    @classmethod
    def _known_broker(cls, value: str) -> str:
        urls = broker_urls(value)
        for url in urls:
            scheme = url.split("://", 1)[0].lower() if "://" in url else ""
            if scheme not in BROKER_SCHEMES:
                raise ValueError(
                    f"{scheme + '://' if scheme else 'a URL without a scheme'} is not a broker this "
                    "package runs on: use amqp:// or amqps:// (RabbitMQ), embedded://PATH, "
                    "or sqs:// (Amazon SQS)"
                )
            if len(urls) > 1 and scheme not in {"amqp", "amqps", "pyamqp"}:
                raise ValueError(
                    "several URLs separated by ';' name the nodes of one RabbitMQ cluster: "
                    f"{scheme}:// cannot be one of them"
                )
            remember_password(url)
            problem = broker_url_problem(url)
            if problem:
                raise ValueError(f"{mask_url(url)}: {problem}")
        return value

    @field_validator("database_url")
    @classmethod
    def _readable_database(cls, value: str) -> str:
        remember_password(value)
        problem = database_url_problem(value)
        if problem:
            raise ValueError(f"{mask_url(value)}: {problem}")
        return value

    @field_validator("heartbeat")
    @classmethod
    def _whole_seconds(cls, value: timedelta) -> timedelta:
        if value < timedelta(0):
            raise ValueError("must not be negative ('0s' turns heartbeats off)")
        return timedelta(seconds=math.ceil(value.total_seconds()))

    @field_validator("database_timeout", "outbox_relay_grace")
    @classmethod
    def _at_least_a_second(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        if value < timedelta(seconds=1):
            raise ValueError(f"must be at least '1s': {_WHY_A_SECOND[str(info.field_name)]}")
        return value

    @field_validator("outbox_relay_interval")
    @classmethod
    def _positive_interval(cls, value: timedelta) -> timedelta:
        if value < timedelta(milliseconds=10):
            raise ValueError("must be at least '10ms' (the relay sweeps the outbox table that often)")
        return value

    @field_validator("metadata")
    @classmethod
    def _module_attribute(cls, value: str | None) -> str | None:
        if value is not None and not _REFERENCE.match(value):
            raise ValueError(
                f"{value!r} is not 'module:attribute', e.g. 'app.models:Base.metadata'"
            )
        return value

    @field_validator("control_interval")
    @classmethod
    def _positive(cls, value: timedelta) -> timedelta:
        if value <= timedelta(0):
            raise ValueError("must be positive: the control loop polls the database at this interval")
        return value


class ConsoleSettings(_Strict):
    """``[console]``: the operators' web page (``mdb console``, README "The console")."""

    bind: str = "127.0.0.1:8089"
    # Required to bind any address but loopback: whoever reaches the page can stop ports.
    token: str | None = None


class QueueSettings(_Strict):
    """``[queues.NAME]``: properties of a destination, declared by the container."""

    backout_threshold: int = Field(default=5, ge=0)
    backout_queue: str | None = None
    max_priority: int | None = Field(default=None, ge=1, le=255)
    redelivery_delay: Duration = timedelta(0)
    redelivery_backoff: float = Field(default=1.0, ge=1.0)
    redelivery_delay_max: Duration = timedelta(minutes=5)
    quorum: bool = False
    expiry_queue: str | None = None


class TopicSettings(_Strict):
    """``[topics.NAME]``: a topic is a durable topic exchange of that name."""


TransactionKind = Literal["container", "bean", "none"]
TransactionAttribute = Literal["Required", "RequiresNew", "NotSupported"]
AcknowledgeMode = Literal["auto", "client", "dups_ok", "transacted"]
ORDERED_PREFETCH = 1000  # the least prefetch of an ordered port without one: room for a hot key's backlog


class PortFields(_Strict):
    """The keys of a ``[ports.NAME]`` table, each checked for its type alone.

    This is what the file (and the environment) says of a port: a layer laid
    over the defaults of its ``@message_driven`` decorator, so the rules that
    tie keys together (exactly one of destination and topic, ...) wait for
    :class:`PortSettings`, which validates the merged result at bind time.
    ``model_fields_set`` tells which keys the file set.
    """

    destination: str | None = None
    topic: str | None = None
    max_retries: int = Field(default=0, ge=0)
    concurrency: int = Field(default=1, ge=1, le=256)
    prefetch: int = Field(default=10, ge=1, le=65535)
    transaction: TransactionKind = "container"
    transaction_attribute: TransactionAttribute = "Required"
    acknowledge: AcknowledgeMode = "auto"
    once_only: bool | None = None
    accept: list[str] = Field(default_factory=lambda: ["application/json", "text/plain"])
    max_message_bytes: int = Field(default=1024 * 1024, ge=1)
    missing_id: Literal["backout", "body-hash"] = "backout"
    client_id: str | None = None
    subscription: str | None = None
    durable: bool = False
    autostart: bool = True
    batch_size: int = Field(default=1, ge=1, le=10000)
    batch_linger: Duration = timedelta(milliseconds=20)
    # A handler call running longer is stuck: /healthz fails naming it (0: off).
    handler_timeout: Duration = timedelta(0)
    # Ordered ports (README "Ordered ports"): the key, what a backout does to it, the partitions.
    order_by: str | None = Field(default=None, min_length=1)
    on_backout: Literal["continue", "hold"] = "continue"
    partitions: int = Field(default=0, ge=0, le=1024)

    @model_validator(mode="before")
    @classmethod
    def _batched_prefetch(cls, data: Any) -> Any:
        """Without an explicit prefetch a batched port prefetches two batches: one runs, one arrives.

        An ordered port prefetches more (``ORDERED_PREFETCH`` and 8 per consumer): the messages
        of a busy or held key wait unacknowledged in the container, and the other keys must
        still reach it past them.
        """
        if isinstance(data, dict) and "prefetch" not in data:
            size = data.get("batch_size")
            prefetch = None
            if isinstance(size, int) and not isinstance(size, bool) and size > 1:
                prefetch = min(65535, 2 * size)
            if data.get("order_by"):
                concurrency = data.get("concurrency")
                per = 8 * concurrency if isinstance(concurrency, int) else 0
                prefetch = min(65535, max(prefetch or 0, ORDERED_PREFETCH, per))
            if prefetch is not None:
                return {**data, "prefetch": prefetch}
        return data

    def overrides(self) -> dict[str, Any]:
        """Only the keys the table set, as they would be written in it."""
        return self.model_dump(exclude_unset=True)


class PortSettings(PortFields):
    """``[ports.NAME]``: a listener port, the consumers that feed one handler.

    Its keys are those of :class:`PortFields`, after decorator defaults and the
    table are merged, and checked together.
    """

    @model_validator(mode="after")
    def _coherent(self) -> PortSettings:
        self._batch_coherent()
        if (self.destination is None) == (self.topic is None):
            raise ValueError("a port needs exactly one of 'destination' (a queue) or 'topic'")
        if self.durable and not (self.client_id and self.subscription):
            raise ValueError("durable = true needs both 'client_id' and 'subscription'")
        if self.topic is None and (self.durable or self.client_id or self.subscription):
            raise ValueError("client_id, subscription and durable apply to a topic port only")
        if self.durable and self.concurrency > 1:
            raise ValueError(
                "a durable subscription has one active subscriber (JMS): concurrency must be 1"
            )
        if self.transaction == "container" and self.acknowledge != "auto":
            raise ValueError(
                f"acknowledge = {self.acknowledge!r} cannot apply with transaction = "
                "'container': the container acknowledges after its commit"
            )
        if self.once_only and not self.transactional:
            raise ValueError(
                "once_only = true needs a database transaction for the dedup row: use "
                "transaction = 'container' (Required) or 'bean'"
            )
        self._order_coherent()
        if "application/x-python-serialize" in self.accept or any(
            "pickle" in ctype for ctype in self.accept
        ):
            raise ValueError("pickle is never accepted: it runs code from the message")
        return self

    def _batch_coherent(self) -> None:
        if self.batch_size == 1:
            return
        if self.prefetch < self.batch_size:
            raise ValueError(
                f"prefetch: {self.prefetch} is below batch_size ({self.batch_size}): a batch "
                "could never fill; raise prefetch or leave it out (then it is 2 x batch_size)"
            )
        if self.acknowledge != "auto":
            raise ValueError(
                f"acknowledge: batch_size > 1 needs acknowledge = 'auto', not {self.acknowledge!r}: "
                "a batch is acknowledged after its commit"
            )
        if self.batch_linger <= timedelta(0):
            raise ValueError("batch_linger: must be positive when batch_size > 1")

    def _order_coherent(self) -> None:
        if self.order_by is None:
            if self.partitions or self.on_backout != "continue":
                raise ValueError("partitions and on_backout apply to an ordered port only: set order_by")
            return
        if self.order_by.startswith("body:") and not self.order_by[5:]:
            raise ValueError("order_by: 'body:' needs a field name, e.g. 'body:account_id'")
        if self.acknowledge != "auto":
            raise ValueError(
                f"order_by needs acknowledge = 'auto', not {self.acknowledge!r}: the keys of an "
                "ordered port end in any order, each acknowledged as it ends"
            )
        if self.partitions and self.destination is None:
            raise ValueError("partitions: needs a destination (a queue), not a topic")

    @property
    def transactional(self) -> bool:
        """True when a database transaction wraps the delivery (CMT Required or BMT)."""
        if self.transaction == "bean":
            return True
        return self.transaction == "container" and self.transaction_attribute != "NotSupported"

    @property
    def is_once_only(self) -> bool:
        """The dedup table applies: on by default wherever a transaction exists."""
        return self.transactional if self.once_only is None else self.once_only

    @property
    def queue_name(self) -> str:
        """The queue the consumers read: the destination, or the subscription's queue."""
        if self.destination is not None:
            return self.destination
        return self.subscription_queue

    @property
    def subscription_queue(self) -> str:
        """A durable subscription is the queue ``CLIENT_ID.SUBSCRIPTION`` (README: JMS mechanisms)."""
        if self.client_id and self.subscription:
            return f"{self.client_id}.{self.subscription}"
        return ""


class Settings(BaseModel):
    """The whole settings file, after environment overrides.

    A plain pydantic model: load_settings() merges the file and the environment itself,
    matching port and queue names case-insensitively (pydantic-settings' environment
    source would lowercase them and create new ports), so pydantic-settings, a tenth of
    a second of every ``mdb`` start, is not imported. Defaults are validated, as there.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    container: ContainerSettings = Field(default_factory=ContainerSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    queues: dict[str, QueueSettings] = Field(default_factory=dict)
    topics: dict[str, TopicSettings] = Field(default_factory=dict)
    # Each table's keys, typed; the port as a whole is validated at bind time, merged
    # over its decorator's defaults (PortSettings).
    ports: dict[str, PortFields] = Field(default_factory=dict)

    source: str = Field(default="<defaults>", exclude=True)
    # Key paths the environment set, so that a later error (at bind time) names the variable.
    overrides: Overrides = Field(default_factory=dict, exclude=True)

    def queue(self, name: str) -> QueueSettings:
        """The properties of queue ``name``: its table, or the defaults."""
        return self.queues.get(name) or QueueSettings()

    def backout_queue_for(self, name: str) -> str:
        """BOQNAME: the queue's backout queue, else the container's dead-letter queue."""
        return self.queue(name).backout_queue or self.container.dead_letter_queue

    def backout_queues(self) -> list[str]:
        """Every backout queue the settings name, the dead-letter queue first."""
        names = [self.container.dead_letter_queue]
        names += [q.backout_queue for q in self.queues.values() if q.backout_queue]
        return list(dict.fromkeys(names))

    def names_queue(self, name: str) -> bool:
        """Whether the settings name queue ``name``, so a publish to it may declare it first.

        A queue named nowhere is never created by a publish (README: *Guarantees*):
        the mandatory publish fails instead, so a typo in a queue name is noticed.
        """
        named = {*self.queues, *self.backout_queues()}
        named |= {q.expiry_queue for q in self.queues.values() if q.expiry_queue}
        named |= {table.destination for table in self.ports.values() if table.destination}
        return name in named

    def port_overrides(self, name: str) -> dict[str, Any]:
        """The keys the file (and environment) set for port ``name``, to lay over decorator defaults."""
        table = self.ports.get(name)
        return table.overrides() if table is not None else {}



EMBEDDED_SCHEME = "embedded://"
EMBEDDED_DEFAULT_FILE = ".mdb/broker.db"


def broker_urls(value: str) -> list[str]:
    """The URLs of ``broker_url``: one, or the nodes of a cluster separated by ``;``."""
    return [url.strip() for url in value.split(";") if url.strip()] or [value]


