"""Durable and non-durable subscriptions, one active subscriber (README: JMS reliability mechanisms)."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import mdb, wait_for
from tests.apps.jms import records
from tests.conftest import RABBITMQ_URL, Backend

pytestmark = pytest.mark.slow


@pytest.fixture
def topic(backend: Backend) -> Any:
    name = f"events.{backend.tag}"
    yield name
    if backend.kind == "rabbitmq":
        import kombu

        with suppress(Exception), kombu.Connection(RABBITMQ_URL) as conn:
            conn.channel().exchange_delete(exchange=name)


def sub_settings(backend: Backend, topic: str, **port: Any) -> Path:
    if port.get("durable"):
        backend.queues.add(f"{port['client_id']}.{port['subscription']}")  # deleted at teardown
    return backend.write(
        ports={"Jms": {"topic": topic, "transaction": "none", **port}}, topics={topic: {}},
        listeners=["tests.apps.jms"],
    )


def publish(backend: Backend, settings: Path, topic: str, *names: str) -> None:
    with backend.producer(settings) as producer:
        for name in names:
            producer.send(topic, {"n": name}, message_id=name)


def received(backend: Backend) -> list[str]:
    return [r["n"] for r in records(backend.log)]


def running(backend: Backend, settings: Path, topic: str, publish_now: list[str], expect: int) -> None:
    """One life of a subscriber: start, publish, wait for ``expect`` messages in all, close."""
    with backend.container(settings) as container:
        publish(backend, settings, topic, *publish_now)
        wait_for(lambda: len(received(backend)) == expect, what=f"{expect} messages in all")
        assert container.terminate() == 0


def test_figure_5_1_a_nondurable_subscriber_loses_what_is_published_while_closed(
    backend: Backend, topic: str
) -> None:
    settings = sub_settings(backend, topic)
    running(backend, settings, topic, ["M1", "M2"], expect=2)
    publish(backend, settings, topic, "M3", "M4")  # closed: nobody subscribes
    running(backend, settings, topic, ["M5", "M6"], expect=4)
    assert received(backend) == ["M1", "M2", "M5", "M6"]


def test_figure_5_2_a_durable_subscriber_receives_what_was_published_while_closed(
    backend: Backend, topic: str
) -> None:
    client_id = backend.q("audit")
    settings = sub_settings(backend, topic, client_id=client_id, subscription="sub", durable=True)
    running(backend, settings, topic, ["M1"], expect=1)
    publish(backend, settings, topic, "M2")
    running(backend, settings, topic, ["M3"], expect=3)
    publish(backend, settings, topic, "M4", "M5")
    running(backend, settings, topic, ["M6"], expect=6)
    assert received(backend) == ["M1", "M2", "M3", "M4", "M5", "M6"]

    result = mdb("unsubscribe", client_id, "sub", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert f"deleted durable subscription {client_id}.sub" in result.stdout
    publish(backend, settings, topic, "M7")  # after unsubscribe: kept by nobody
    running(backend, settings, topic, ["M8"], expect=7)
    assert received(backend)[-1] == "M8" and "M7" not in received(backend)


def test_one_active_subscriber_per_durable_subscription(backend: Backend, topic: str) -> None:
    client_id = backend.q("audit")
    settings = sub_settings(backend, topic, client_id=client_id, subscription="sub", durable=True)
    queue = f"{client_id}.sub"
    first = backend.container(settings).start()
    second = backend.container(settings, log_path=backend.tmp / "second.log").start(wait=False)
    try:
        def refused() -> Any:
            state = second.port_state("Jms") or {}
            return state.get("state") == "stopped" and "is active" in state.get("reason", "") and state

        state = wait_for(refused, what="the second subscriber refused")
        assert f"durable subscription '{queue}' is active" in state["reason"]
        assert "JMS allows one active subscriber" in state["reason"]
        assert (first.port_state("Jms") or {}).get("state") == "started"
        publish(backend, settings, topic, "M1")
        wait_for(lambda: received(backend) == ["M1"], what="the first subscriber to receive")

        result = mdb("unsubscribe", client_id, "sub", settings=settings, env=backend.env)
        assert result.returncode == 1
        assert result.stderr.count("\n") == 1
        assert f"durable subscription '{queue}' is active" in result.stderr

        assert first.terminate() == 0  # the first closes: the second may take over
        assert mdb("port", "start", "Jms", settings=settings, env=backend.env).returncode == 0
        wait_for(lambda: (second.port_state("Jms") or {}).get("state") == "started",
                 what="the second subscriber to take over")
        publish(backend, settings, topic, "M2")
        wait_for(lambda: received(backend) == ["M1", "M2"], what="the second subscriber to receive")
        assert second.terminate() == 0
    finally:
        for container in (first, second):
            if container.alive():
                container.kill()
    result = mdb("unsubscribe", client_id, "sub", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    result = mdb("unsubscribe", client_id, "sub", settings=settings, env=backend.env)
    assert result.returncode == 1
    assert f"no durable subscription '{queue}'" in result.stderr


def test_subscription_settings_that_cannot_apply_are_refused() -> None:
    from mdbcontainer.errors import SettingsError
    from mdbcontainer.settings import validate_port

    durable = {"topic": "t", "client_id": "c", "subscription": "s", "durable": True}
    with pytest.raises(SettingsError, match="one active subscriber .JMS.: concurrency must be 1"):
        validate_port("s.toml", "P", {**durable, "concurrency": 2})
    with pytest.raises(SettingsError, match="apply to a topic port only"):
        validate_port("s.toml", "P", {"destination": "Q", "durable": True, "client_id": "c",
                                      "subscription": "s"})
    validate_port("s.toml", "P", durable)
