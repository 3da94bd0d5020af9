"""Security basics: no pickle, no forged control headers, no secrets in any output."""

from __future__ import annotations

import pickle
import subprocess
from pathlib import Path

import kombu
import pytest

from mdbcontainer.testing import mdb, wait_for
from tests.conftest import Backend, mdb_here, one_line_error, require

pytestmark = pytest.mark.slow


class WritesAFile:
    """Unpickling this runs ``open(path, "w")``: what a pickle payload can do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def publish_raw(backend: Backend, settings: Path, queue: str, body: bytes, **props: object) -> None:
    conn = backend.probe(settings).broker.connect()
    try:
        kombu.Producer(conn.channel()).publish(
            body, routing_key=queue, exchange="", serializer=None, delivery_mode=2, **props
        )
    finally:
        conn.close()


def test_a_pickle_payload_is_never_unpickled(backend: Backend) -> None:
    queue = backend.q("PICKLE")
    target = backend.tmp / "pwned"
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5,
                                             "accept": ["application/json", "text/plain"]}})
    with backend.container(settings) as container:
        publish_raw(backend, settings, queue, pickle.dumps(WritesAFile(str(target))),
                    content_type="application/x-python-serialize", content_encoding="binary",
                    message_id="pickle")
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
        assert container.port_state("Work")["state"] == "started"
    assert not target.exists(), "the pickle was never loaded"
    [dead] = backend.probe(settings).take_all(backend.q("DLQ"))
    assert dict(dead.headers)["x-mdb-backout-reason"] == "invalid-body"
    assert "not accepted" in dict(dead.headers)["x-mdb-exception"]


def test_pickle_cannot_be_enabled(tmp_path: Path) -> None:
    from mdbcontainer.errors import SettingsError
    from mdbcontainer.settings import validate_port

    with pytest.raises(SettingsError, match="pickle is never accepted"):
        validate_port("s.toml", "P", {"destination": "Q", "accept": ["application/x-python-serialize"]})


def test_forged_control_headers_change_nothing(backend: Backend) -> None:
    queue = backend.q("FORGED")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 2}})
    forged = {"x-mdb-redelivery-count": 99, "x-delivery-count": 99, "x-mdb-backout-reason": "ok",
              "x-mdb-port": "Other"}
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1}, message_id="good", headers=forged)
        producer.send(queue, {"n": 2, "action": "fail"}, message_id="poison", headers=forged)
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(backend.q("DLQ")) == 1, what="backout")
    assert backend.effects() == {"good": 1}, "a forged count does not back a good message out"
    assert [a[3] for a in backend.attempts() if a[1] == "poison"] == [0, 1]
    [dead] = backend.probe(settings).take_all(backend.q("DLQ"))
    headers = dict(dead.headers)
    assert headers["x-mdb-redelivery-count"] == 2
    assert headers["x-mdb-port"] == "Work"
    assert headers["x-mdb-backout-reason"] == "backout-threshold"


RABBIT_USER, RABBIT_PASSWORD = "mdb_secret_test", "Rabbit-S3cret-pw"
PG_PASSWORD = "Pg-S3cret-pw"


def ensure_rabbit_user() -> None:
    subprocess.run(["rabbitmqctl", "add_user", RABBIT_USER, RABBIT_PASSWORD],
                   capture_output=True, timeout=60)
    subprocess.run(["rabbitmqctl", "set_permissions", "-p", "/", RABBIT_USER, ".*", ".*", ".*"],
                   check=True, capture_output=True, timeout=60)


@pytest.mark.rabbitmq
def test_passwords_never_appear_in_any_output(rabbit: Backend) -> None:
    require(5672, "RabbitMQ")
    ensure_rabbit_user()
    queue = rabbit.q("SECRET")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 0}},
        broker_url=f"amqp://{RABBIT_USER}:{RABBIT_PASSWORD}@127.0.0.1:5672//",
        database_url=f"postgresql+psycopg://postgres:{PG_PASSWORD}@127.0.0.1:5432/test",
        connect_timeout="2s",
    )

    def output_of(*args: str) -> str:
        result = mdb(*args, settings=settings, env=rabbit.env)
        return result.stdout + result.stderr

    outputs = [output_of("check")]
    with rabbit.container(settings) as container:
        outputs.append(output_of("send", queue, '{"n": 1, "action": "fail"}'))
        wait_for(lambda: (container.port_state("Work") or {}).get("state") == "stopped",
                 what="the port to stop on the failure")
        outputs += [output_of("ports"), output_of("ports", "--json"), output_of("dlq", "list")]
    outputs.append(container.output())
    bad_broker = settings.read_text().replace("127.0.0.1:5672", "127.0.0.1:1")
    settings.write_text(bad_broker)
    outputs.append(output_of("send", queue, "{}"))
    everything = "\n".join(outputs)
    assert "RuntimeError: poison message 1" in everything, "the outputs were captured"
    assert RABBIT_PASSWORD not in everything
    assert PG_PASSWORD not in everything
    assert f"{RABBIT_USER}:***@" in everything


def test_a_password_with_a_slash_or_an_at_sign_never_shows_and_a_misread_url_is_a_settings_error(
    rabbit: Backend,
) -> None:
    """``/`` in a database password is a URL SQLAlchemy reads as meant: it connects, and the password
    is masked. ``/`` in a broker password, ``@`` in a database one: no client would read the URL as
    meant, so ``mdb check`` says how to write it (exit 2), and neither shows the password."""
    ports = {"Work": {"destination": rabbit.q("IN"), "max_retries": 5}}
    slash = rabbit.write(ports=ports,
                         database_url="postgresql+psycopg://postgres:s3/cr3t-pg@127.0.0.1:5432/test")
    result = mdb_here("check", settings=slash, env=rabbit.env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "postgresql+psycopg://postgres:***@127.0.0.1:5432/test" in out
    assert "cr3t" not in out

    broker = rabbit.write("broker.toml", ports=ports, broker_url="amqp://guest:s3/cr3t-mq@127.0.0.1:5672//")
    line = one_line_error(mdb_here("check", settings=broker, env=rabbit.env), 2)
    assert "container.broker_url" in line and "%2F" in line and "guest:***@127.0.0.1" in line, line
    assert "cr3t" not in line

    at = rabbit.write("at.toml", ports=ports,
                      database_url="postgresql+psycopg://postgres:pa@ss-w0rd@127.0.0.1:5432/test")
    line = one_line_error(mdb_here("check", settings=at, env=rabbit.env), 2)
    assert "container.database_url" in line and "%40" in line, line
    assert "ss-w0rd" not in line


def test_the_exception_kept_in_x_mdb_exception_masks_passwords() -> None:
    """Secrets never appear in errors; x-mdb-exception is printed by mdb dlq show."""
    from mdbcontainer.support.failures import exception_text

    try:
        raise RuntimeError("cannot reach https://svc:hunter2@api.example/ (password=hunter2)")
    except RuntimeError as exc:
        text = exception_text(exc)
    assert "hunter2" not in text
    assert "RuntimeError: cannot reach https://svc:***@api.example/" in text
