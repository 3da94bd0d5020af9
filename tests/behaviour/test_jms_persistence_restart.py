"""JMS mechanisms (README): persistent messages survive a broker restart; non-persistent ones do not.

Restarts the real RabbitMQ (``rabbitmqctl stop_app`` / ``start_app``) and leaves it running.
"""

from __future__ import annotations

import shutil
import time

import pytest

from mdbcontainer.testing import mdb, wait_for
from tests.chaos.faults import disruptive_lock
from tests.conftest import Backend, rabbitmqctl, reachable

pytestmark = [pytest.mark.disruptive, pytest.mark.slow]


def restart_rabbitmq() -> None:
    """stop_app then start_app, holding the machine-wide lock of runs that stop a service;
    back when the app runs and 5672 accepts connections."""
    with disruptive_lock():
        try:
            rabbitmqctl("stop_app")
            time.sleep(1)
        finally:
            rabbitmqctl("start_app")
            rabbitmqctl("await_startup")
            wait_for(lambda: reachable(5672), timeout=60, what="RabbitMQ to accept connections")


def test_persistent_messages_survive_a_rabbitmq_restart_and_transient_ones_do_not(
    rabbit: Backend,
) -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is not on PATH: this test restarts the local RabbitMQ")
    queue = rabbit.q("DURABLE")
    settings = rabbit.write(
        ports={"Jms": {"destination": queue, "transaction": "none"}}, queues={queue: {}},
        listeners=["tests.apps.jms"],
    )
    with rabbit.producer(settings) as producer:
        for n in range(3):
            producer.send(queue, {"n": n}, message_id=f"persistent-{n}")
    for n in range(3):
        result = mdb("send", queue, f'{{"n": {n}}}', "--non-persistent", "--id", f"transient-{n}",
                     settings=settings, env=rabbit.env)
        assert result.returncode == 0, result.stderr
    assert rabbit.probe(settings).count(queue) == 6
    restart_rabbitmq()
    kept = [m.properties["message_id"] for m in rabbit.probe(settings).take_all(queue)]
    assert kept == ["persistent-0", "persistent-1", "persistent-2"]
