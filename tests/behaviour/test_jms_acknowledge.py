"""JMS mechanisms (README): acknowledgment modes (client, dups_ok, transacted) and local transactions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mdbcontainer.testing import ContainerProcess, mdb, wait_for
from tests.apps.jms import records
from tests.conftest import ROOT, Backend, jms_settings

pytestmark = pytest.mark.slow


def send(backend: Backend, settings: Path, queue: str, bodies: list[dict[str, Any]]) -> None:
    with backend.producer(settings) as producer:
        for body in bodies:
            producer.send(queue, body, message_id=f"m{body['n']}")


def seen(backend: Backend) -> list[int]:
    return [r["n"] for r in records(backend.log)]


def crashing(backend: Backend, settings: Path, point: str) -> ContainerProcess:
    """A container that SIGKILLs itself once at crash point ``point``."""
    env = {**backend.env, "MDB_CRASH_AT": point, "MDB_CRASH_ONCE_FILE": str(backend.tmp / "crashed")}
    return ContainerProcess(settings, env=env, cwd=ROOT)


# -- auto, no transaction: a first delivery's flat path (pipeline/single.py) ----------


@pytest.mark.parametrize(("point", "twice"), [("before-handler", []), ("in-handler", [2]),
                                              ("after-ack", [])])
def test_auto_without_a_transaction_crashing_at_a_first_delivery_step_redelivers_what_was_not_acked(
        backend: Backend, point: str, twice: list[int]) -> None:
    """The crash points of a first delivery on a ``none`` port are where they always were: a kill
    before the handler loses nothing, in it runs the handler again, after the ack does not."""
    queue = backend.q("AUTO")
    settings = jms_settings(backend, queue, transaction="none", prefetch=20)
    send(backend, settings, queue, [{"n": n} for n in range(1, 5)])
    with crashing(backend, settings, f"{point}:2").start(wait=False) as container:
        assert container.wait_exit(60) != 0, "killed itself at the crash point"
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(queue) == 0, what="every message handled")
        wait_for(lambda: sorted(set(seen(backend))) == [1, 2, 3, 4], what="all four seen")
    assert sorted(seen(backend)) == sorted([1, 2, 3, 4, *twice])
    redelivered = [r for r in records(backend.log) if r["redelivered"]]
    assert {r["n"] for r in redelivered} >= set(twice)


# -- client ---------------------------------------------------------------------------


def test_client_ack_of_the_fifth_of_ten_then_a_kill_redelivers_six_to_ten(backend: Backend) -> None:
    queue = backend.q("CLIENT")
    settings = jms_settings(backend, queue, transaction="none", acknowledge="client", prefetch=20)
    send(backend, settings, queue, [{"n": n, "action": "ack" if n == 5 else "ok"} for n in range(1, 11)])
    with backend.container(settings) as container:
        wait_for(lambda: len(seen(backend)) == 10, what="ten messages received")
        container.kill()
    wait_for(lambda: backend.probe(settings).count(queue) == 5, what="the unacknowledged five back")
    with backend.container(settings):
        wait_for(lambda: len(seen(backend)) == 15, what="the redeliveries")
    redelivered = records(backend.log)[10:]
    assert sorted(r["n"] for r in redelivered) == [6, 7, 8, 9, 10]
    assert all(r["redelivered"] for r in redelivered)
    assert seen(backend)[:10] == list(range(1, 11))


def test_client_recover_and_port_stop_hand_messages_back_without_counting_failures(
    backend: Backend,
) -> None:
    queue = backend.q("RECOVER")
    settings = jms_settings(backend, queue, transaction="none", acknowledge="client", prefetch=20)
    with backend.container(settings) as container:
        send(backend, settings, queue, [{"n": 1}, {"n": 2, "action": "recover"}])
        wait_for(lambda: len(seen(backend)) == 4, what="both messages recovered and redelivered")
        first, second, again1, again2 = records(backend.log)
        assert [first["n"], second["n"]] == [1, 2]
        assert {again1["n"], again2["n"]} == {1, 2}
        assert again1["redelivered"] and again2["redelivered"]
        assert again1["count"] == again2["count"] == 0, "recover() is not a failed delivery"
        send(backend, settings, queue, [{"n": 3, "action": "ack"}])
        wait_for(lambda: len(seen(backend)) == 5, what="the acknowledging message")
        wait_for(lambda: backend.probe(settings).count(queue) == 0, what="nothing left")

        send(backend, settings, queue, [{"n": 4}])
        wait_for(lambda: len(seen(backend)) == 6, what="a message held unacknowledged")
        assert mdb("port", "stop", "Jms", settings=settings, env=backend.env).returncode == 0
        wait_for(lambda: (container.port_state("Jms") or {}).get("state") == "stopped",
                 what="the port to stop")
        wait_for(lambda: backend.probe(settings).count(queue) == 1,
                 what="the held message back on its queue")
        assert mdb("port", "start", "Jms", settings=settings, env=backend.env).returncode == 0
        wait_for(lambda: len(seen(backend)) == 7, what="its redelivery")
    last = records(backend.log)[-1]
    assert (last["n"], last["redelivered"], last["count"]) == (4, True, 0)
    assert backend.probe(settings).count(backend.q("DLQ")) == 0


def test_acknowledge_modes_apply_to_bean_and_none_ports_only() -> None:
    from mdbcontainer.errors import SettingsError
    from mdbcontainer.settings import validate_port

    for mode in ("client", "dups_ok", "transacted"):
        with pytest.raises(SettingsError, match=rf"ports\.P.*acknowledge = '{mode}' cannot apply"):
            validate_port("s.toml", "P", {"destination": "Q", "acknowledge": mode})
        validate_port("s.toml", "P", {"destination": "Q", "acknowledge": mode, "transaction": "none"})
        validate_port("s.toml", "P", {"destination": "Q", "acknowledge": mode, "transaction": "bean"})


# -- dups_ok --------------------------------------------------------------------------


def test_dups_ok_acknowledges_in_batches_and_dedup_absorbs_the_unacknowledged_tail(
    backend: Backend,
) -> None:
    queue = backend.q("LAZY")
    # prefetch 20: batches of 10. The 13th delivery kills the process after its commit,
    # so 11 to 13 were handled but not yet acknowledged.
    settings = jms_settings(backend, queue, transaction="bean", acknowledge="dups_ok", prefetch=20)
    send(backend, settings, queue, [{"n": n} for n in range(1, 14)])
    with crashing(backend, settings, "in-handler:13").start(wait=False) as container:
        assert container.wait_exit(60) != 0
    wait_for(lambda: backend.probe(settings).count(queue) == 3,
             what="the tail back: the batch of ten was acknowledged, not the last three")
    with backend.container(settings) as container:
        wait_for(lambda: backend.probe(settings).count(queue) == 0, what="the tail redelivered")
        wait_for(lambda: (container.port_state("Jms") or {}).get("duplicate_skipped") == 3,
                 what="three duplicates skipped")
        send(backend, settings, queue, [{"n": n} for n in range(14, 17)])
        wait_for(lambda: len(seen(backend)) == 16, what="three more")
        assert container.terminate() == 0
    assert backend.probe(settings).count(queue) == 0, "the last batch was flushed at shutdown"
    assert seen(backend) == list(range(1, 17)), "no handler ran twice"
    assert backend.effects() == {f"m{n}": 1 for n in range(1, 17)}


# -- transacted (local transactions) --------------------------------------------------


def test_transacted_sends_and_receive_roll_back_and_commit_as_one(rabbit: Backend) -> None:
    queue, out1, out2 = rabbit.q("TX"), rabbit.q("OUT1"), rabbit.q("OUT2")
    settings = jms_settings(rabbit, queue, {queue: {}, out1: {}, out2: {}}, transaction="none",
                            acknowledge="transacted", max_retries=5)
    send(rabbit, settings, queue, [{"n": 1, "action": "send", "to": [out1, out2], "then_fail": True}])
    with rabbit.container(settings):
        wait_for(lambda: len(seen(rabbit)) == 2, what="a rollback, then a commit")
        probe = rabbit.probe(settings)  # the first send declares the queues
        wait_for(lambda: probe.exists(out2) and probe.count(out2) == 1, what="the committed sends")
    assert [r["count"] for r in records(rabbit.log)] == [0, 1], "the rollback redelivered it"
    probe = rabbit.probe(settings)
    assert [m.properties["message_id"] for m in probe.take_all(out1)] == [f"m1.{out1}"]
    assert [m.properties["message_id"] for m in probe.take_all(out2)] == [f"m1.{out2}"]
    assert probe.count(queue) == 0


def test_a_crash_before_the_commit_loses_the_sends_and_redelivers_the_message(rabbit: Backend) -> None:
    queue, out1, out2 = rabbit.q("TXCRASH"), rabbit.q("OUT1"), rabbit.q("OUT2")
    settings = jms_settings(rabbit, queue, {queue: {}, out1: {}, out2: {}}, transaction="none",
                            acknowledge="transacted", max_retries=5)
    send(rabbit, settings, queue, [{"n": 1, "action": "send", "to": [out1, out2]}])
    with crashing(rabbit, settings, "before-tx-commit").start(wait=False) as container:
        assert container.wait_exit(60) != 0
    probe = rabbit.probe(settings)
    assert (probe.count(out1), probe.count(out2), probe.count(queue)) == (0, 0, 1), \
        "the published sends died with the uncommitted transaction"
    with rabbit.container(settings):
        wait_for(lambda: probe.count(out2) == 1, what="the sends of the redelivery")
    assert probe.count(out1) == 1 and probe.count(queue) == 0
    assert len(seen(rabbit)) == 2


def test_transacted_is_refused_on_the_embedded_broker(tmp_path: Path) -> None:
    backend = Backend("embedded", tmp_path)
    try:
        settings = jms_settings(backend, backend.q("TX"), transaction="none", acknowledge="transacted")
        container = backend.container(settings).start(wait=False)
        assert container.wait_exit(30) == 2
        errors = [line for line in container.output().splitlines() if line.startswith("mdb: error")]
        assert len(errors) == 1
        assert "ports.Jms.acknowledge: 'transacted' needs AMQP channel transactions" in errors[0]
    finally:
        backend.close()
