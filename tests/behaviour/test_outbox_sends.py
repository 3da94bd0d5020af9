"""Sends from code outside handlers survive the death of the sender and of the relay.

A web process (here a script) that commits its outbox sends and is SIGKILLed
right after: a running container's relay publishes them, each once. ``mdb
relay`` SIGKILLed between its publish and the rows' removal (crash point
``outbox-relay``): the rows stay, a container's relay publishes them again with
the same ids, and the once-only port ``Downstream`` applies each once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from mdbcontainer import Outbox
from mdbcontainer.testing import wait_for
from tests.conftest import ROOT, Backend

pytestmark = pytest.mark.slow

SENDER = textwrap.dedent("""
    import os, signal, sys
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session
    from mdbcontainer import Outbox, load_settings

    settings = load_settings(sys.argv[1], environ={})
    outbox = Outbox.from_settings(settings)
    engine = create_engine(settings.container.database_url)
    with Session(engine) as session, session.begin():
        for n in range(int(sys.argv[3])):
            outbox.send(session, sys.argv[2], {"action": "ok", "n": n}, message_id=f"web-{n}")
    os.kill(os.getpid(), signal.SIGKILL)  # right after the commit: nothing of this process remains
""")


def downstream_settings(backend: Backend, queue: str) -> Path:
    return backend.write(ports={"Downstream": {"destination": queue}}, queues={queue: {}},
                         outbox_relay_interval="200ms")


def outbox_of(backend: Backend, settings: Path) -> Outbox:
    outbox = Outbox.from_settings(backend.settings(settings))
    outbox.create_tables()
    return outbox


def test_a_web_process_killed_right_after_its_commit_has_its_sends_published_once(
        backend: Backend) -> None:
    queue = backend.q("DOWN")
    settings = downstream_settings(backend, queue)
    with backend.container(settings) as container:
        sender = subprocess.run([sys.executable, "-c", SENDER, str(settings), queue, "5"],
                                cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert sender.returncode == -9, sender.stderr
        ids = {f"web-{n}" for n in range(5)}
        wait_for(lambda: set(backend.effects("Downstream")) == ids, timeout=30,
                 what="every committed send applied downstream")
        outbox = outbox_of(backend, settings)
        wait_for(lambda: outbox.waiting().count == 0, what="the outbox emptied")
        outbox.store.dispose()
        assert container.alive()
    assert backend.effects("Downstream") == Counter(ids), "each once"
    assert Counter(a[1] for a in backend.attempts("Downstream")) == Counter(ids), "published once each"


def test_a_relay_killed_after_its_publish_publishes_again_and_a_once_only_port_applies_once(
        backend: Backend) -> None:
    queue = backend.q("DOWN")
    settings = downstream_settings(backend, queue)
    outbox = outbox_of(backend, settings)
    from sqlalchemy.orm import Session

    with Session(backend.engine) as session, session.begin():
        for n in range(3):
            outbox.send(session, queue, {"action": "ok", "n": n}, message_id=f"relayed-{n}")
    relay = subprocess.run([sys.executable, "-m", "mdbcontainer", "relay", "-c", str(settings)],
                           cwd=ROOT, env={**backend.env, **_environ(), "MDB_CRASH_AT": "outbox-relay"},
                           capture_output=True, text=True, timeout=60)
    assert relay.returncode == -9, relay.stderr
    assert outbox.waiting().count == 3, "killed before it removed the rows"
    ids = {f"relayed-{n}" for n in range(3)}
    with backend.container(settings) as container:
        wait_for(lambda: outbox.waiting().count == 0, timeout=30, what="the rows relayed again")

        def skipped() -> int:
            row = container.port_state("Downstream") or {}
            return int(row.get("duplicate_skipped") or 0)

        wait_for(lambda: skipped() == 3, timeout=30,
                 what="the second copy of each delivered and skipped as a duplicate")
    outbox.store.dispose()
    assert Counter(a[1] for a in backend.attempts("Downstream")) == Counter(ids), \
        "the handler ran once per id"
    assert backend.effects("Downstream") == Counter(ids), "and its work was applied once"


def _environ() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "MDB_CRASH_AT"}


def test_waiting_sends_and_the_oldest_age_show_in_mdb_outbox_and_metrics(backend: Backend) -> None:
    """A send to a queue that does not exist waits (the broker returns it): counted and aged."""
    from tests.behaviour.helpers import free_port, scrape

    queue, missing = backend.q("DOWN"), backend.q("NOWHERE")
    port = free_port()
    settings = backend.write(ports={"Downstream": {"destination": queue}}, queues={queue: {}},
                             outbox_relay_interval="200ms", outbox_relay_grace="1s", metrics_port=port)
    outbox = outbox_of(backend, settings)
    from sqlalchemy.orm import Session

    with Session(backend.engine) as session, session.begin():
        outbox.send(session, missing, {"action": "ok"}, message_id="stuck-1")
        outbox.send(session, queue, {"action": "ok"}, message_id="goes-1")
    with backend.container(settings):
        wait_for(lambda: "goes-1" in backend.effects("Downstream"), timeout=30,
                 what="the routable send published past the stuck one")

        def gauges() -> tuple[float, float]:
            samples = scrape(port)
            return samples[("mdb_outbox_waiting", ())], samples[("mdb_outbox_oldest_seconds", ())]

        wait_for(lambda: gauges()[0] == 1 and gauges()[1] >= 1, timeout=30,
                 what="one send waiting, for a second or more, on /metrics")
        shown = subprocess.run([sys.executable, "-m", "mdbcontainer", "outbox", "-c", str(settings)],
                               cwd=ROOT, capture_output=True, text=True, timeout=60, env=_environ())
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith("outbox: 1 send waiting, the oldest for "), shown.stdout
        listed = subprocess.run([sys.executable, "-m", "mdbcontainer", "ports", "-c", str(settings)],
                                cwd=ROOT, capture_output=True, text=True, timeout=60, env=_environ())
        assert "outbox: 1 send waiting" in listed.stdout.splitlines()[-1], listed.stdout
    outbox.store.dispose()
