"""The fleet's port switches and the containers' heartbeats (``state.control``), on a real database.

A switch is one row per port that every replica polls; each write is a new
generation, so a replica tells a new stop from the one it already obeyed.
``mdb ports`` reads the heartbeats that are fresh, and a dead process's row
goes at once when its supervisor saw it die.
"""

from __future__ import annotations

import os
from datetime import timedelta

from mdbcontainer.state.control import STALE_AFTER, Control, Wanted
from mdbcontainer.state.store import Store, utcnow


def test_a_switch_is_seen_by_every_replica_with_a_new_generation_each_time(store: Store) -> None:
    one, other = Control(store, "host:1:a"), Control(store, "host:2:b")
    assert one.wanted() == {}
    one.set_port("Orders", "stopped", "message m-1 failed 1 time(s): RuntimeError: boom")
    assert other.wanted() == {"Orders": Wanted("stopped", "message m-1 failed 1 time(s): RuntimeError: boom", 1)}
    other.set_port("Orders", "started")
    other.set_port("Orders", "started")
    assert one.wanted()["Orders"] == Wanted("started", "", 3), "the same state again is a new switch"


def test_the_ports_of_containers_with_a_fresh_heartbeat_are_live(store: Store) -> None:
    a, b = Control(store, "host:1:a"), Control(store, "host:2:b")
    for control, state in ((a, "started"), (b, "stopped")):
        control.register()
        control.heartbeat([{"port": "Orders", "state": state, "handled": 3}])
    assert [(p["container"], p["state"]) for p in a.live()] == [("host:1:a", "started"),
                                                                ("host:2:b", "stopped")]
    later = utcnow() + STALE_AFTER + timedelta(seconds=1)
    assert a.live(later) == [], "a heartbeat older than STALE_AFTER is a container gone"
    assert len(a.live(later, control_interval=timedelta(seconds=10))) == 2, "three slow heartbeats"
    b.deregister()
    assert [p["container"] for p in a.live()] == ["host:1:a"]


def test_the_row_of_a_process_its_supervisor_saw_die_goes_at_once(store: Store) -> None:
    control = Control(store, f"here:{os.getpid()}:x")
    control.register()
    assert control.forget_process(os.getpid(), utcnow() - timedelta(minutes=1)) == 0, \
        "a row started after the death is a new process given the same pid"
    assert control.forget_process(os.getpid(), utcnow()) == 1
    assert control.live() == []
