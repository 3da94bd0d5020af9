"""A RabbitMQ restart while a failed message waits out its redelivery delay loses nothing and
applies nothing twice: the wait queue is durable and the copy on it persistent.

Restarts the real RabbitMQ (``rabbitmqctl stop_app`` / ``start_app``) and leaves it running.
(On the embedded broker the broker is its file: a crash of the only process that holds it is
tests/behaviour/test_delays.py's crash test.)
"""

from __future__ import annotations

import shutil

import pytest

from mdbcontainer.testing import wait_for
from tests.chaos.faults import restart_broker_app
from tests.conftest import Backend, delayed_settings

pytestmark = [pytest.mark.disruptive, pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.postgres]


def test_a_rabbitmq_restart_keeps_the_waiting_message(rabbit: Backend) -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.fail("rabbitmqctl is not on PATH: this test restarts the local RabbitMQ")
    queue = rabbit.q("RESTART")
    # The delay outlasts the restart (stop_app, a second, start_app: 3-4 s here) with room to spare.
    settings = delayed_settings(rabbit, queue, redelivery_delay="15s")
    wait = f"{queue}.wait.15s"
    with rabbit.container(settings) as container:
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1, "fail": 1}, message_id="kept")
        probe = rabbit.probe(settings)
        wait_for(lambda: probe.count(wait) == 1, what="the message waiting")
        down = restart_broker_app(pause=1.0)
        assert down < 12, f"RabbitMQ took {down:.0f}s to restart: the wait would nearly be over"
        assert probe.count(wait) == 1, "the waiting message survived the restart"
        wait_for(lambda: "kept" in rabbit.effects(), timeout=120, what="the message after its wait")
        wait_for(lambda: probe.count(wait) == 0 and probe.count(queue) == 0, what="nothing left")
        assert container.alive()
    assert rabbit.effects() == {"kept": 1}
    assert [a[3] for a in rabbit.attempts()] == [0, 1], "one failure counted, applied once"
