"""The chaos run in the test suite (tests/chaos/run.py).

The short run (1200 messages to the ports of both transaction kinds, def and
async def, in one container; 3 SIGKILLs, the container's broker connections
closed by the broker, PostgreSQL refusing the container for 5 s) runs with
the other slow tests: its faults touch only its own container. The run with
a broker restart (600 messages, 1 SIGKILL, a RabbitMQ stop_app/start_app)
stops the broker, so it is ``disruptive``: alone, last, while the rest of the
suite waits. ``make chaos`` runs the full one (5000 messages, 10 SIGKILLs) by
itself. The SQS run (moto's server + PostgreSQL: 240 messages to the same four
ports, 3 SIGKILLs, PostgreSQL refusing the container for 5 s) cuts the
container off the endpoint for 2-5 s instead of a broker restart: moto keeps
its queues in memory, and a restart would lose them. The
seed is random and printed; ``MDB_CHAOS_SEED=N`` replays a run.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos.run import ChaosRun, Plan
from tests.conftest import Backend

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def seed() -> int:
    chosen = os.environ.get("MDB_CHAOS_SEED")
    return int(chosen) if chosen else random.SystemRandom().randrange(1_000_000)


@pytest.mark.rabbitmq
@pytest.mark.timeout(400)
def test_short_chaos_run_loses_nothing_and_applies_nothing_twice(rabbit: Backend) -> None:
    failures = ChaosRun(rabbit, Plan.short(seed())).run()
    assert failures == []


@pytest.mark.timeout(300)
def test_short_chaos_run_on_sqs_loses_nothing_and_applies_nothing_twice(sqs_postgres: Backend) -> None:
    failures = ChaosRun(sqs_postgres, Plan.sqs(seed())).run()
    assert failures == []


@pytest.mark.rabbitmq
@pytest.mark.disruptive
@pytest.mark.timeout(900)
def test_chaos_run_with_a_broker_restart(rabbit: Backend) -> None:
    failures = ChaosRun(rabbit, Plan.restart(seed())).run()
    assert failures == []
