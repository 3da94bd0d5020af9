"""``mdb dlq``: browse, show, replay and purge backout queues, driven as a user would.

Backed-out messages come from a real container (port Work, backout threshold
2); the CLI runs as a second process against the same settings file.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete

from mdbcontainer.state.history import History
from mdbcontainer.state.store import Store
from mdbcontainer.testing import mdb, wait_for, write_settings
from mdbcontainer.wire.connection import Broker
from mdbcontainer.wire.publisher import Publisher
from tests.conftest import Backend, mdb_here, on_embedded, one_line_error

pytestmark = pytest.mark.slow

BINARY = b"\xff\xfe\x00binary"


def listed(backend: Backend, settings: Path, *queue: str) -> list[dict[str, Any]]:
    """``mdb dlq list --json`` in this process (polled in loops: no Python start-up per poll); the
    tests' other ``mdb dlq`` commands run as processes, as a user types them."""
    result = mdb_here("dlq", "list", *queue, "--json", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert isinstance(data, list)
    return data


def publish_raw(backend: Backend, settings: Path, queue: str, message_id: str, body: bytes,
                content_type: str) -> None:
    """A message from a producer that is not this package: bytes with a type no port accepts."""
    with Publisher(Broker(backend.settings(settings))) as publisher:
        exchange, routing_key, mandatory = publisher.route(queue)
        publisher.publish(
            exchange=exchange, routing_key=routing_key, body=body, mandatory=mandatory,
            properties={"message_id": message_id, "content_type": content_type,
                        "content_encoding": "binary", "delivery_mode": 2},
        )


def work_settings(backend: Backend, queue: str) -> Path:
    """Port Work on ``queue``: JSON only, backout after 2 deliveries, never stopped by them.

    The settings name the PARKED queue, so that a replay ``--to`` it declares it.
    """
    return backend.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1,
                        "accept": ["application/json"]}},
        queues={queue: {"backout_threshold": 2}, backend.q("PARKED"): {}},
    )


def attempts_of(backend: Backend, message_id: str) -> list[int]:
    """The redelivery counts the handler saw for ``message_id``, in order."""
    return [a[3] for a in backend.attempts() if a[1] == message_id]


def test_list_and_show_browse_without_consuming(backend: Backend) -> None:
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail"}, message_id="failing")
        producer.send(queue, {"n": 2, "action": "rollback"}, message_id="rolled-back")
        producer.send(queue, "plain words", message_id="text-body")  # text/plain: not accepted
    publish_raw(backend, settings, queue, "binary-body", BINARY, "application/octet-stream")
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(dlq) == 4, what="four backouts")

    first = listed(backend, settings)
    second = listed(backend, settings, dlq)
    assert [m["id"] for m in first] == ["failing", "rolled-back", "text-body", "binary-body"]
    assert first == second, "browsing twice sees the same messages in the same order"
    assert backend.probe(settings).count(dlq) == 4, "browsing consumed nothing"

    by_id = {m["id"]: m for m in first}
    failing = by_id["failing"]
    assert failing["original_destination"] == queue
    assert failing["port"] == "Work"
    assert failing["reason"] == "backout-threshold"
    assert failing["redelivery_count"] == 2
    assert datetime.fromisoformat(failing["failed_at"]).tzinfo is not None
    assert failing["body"] == {"n": 1, "action": "fail"}
    assert "RuntimeError: poison message 1" in failing["headers"]["x-mdb-exception"]
    assert "set_rollback_only" in by_id["rolled-back"]["headers"]["x-mdb-exception"]
    text = by_id["text-body"]
    assert (text["reason"], text["redelivery_count"]) == ("invalid-body", 0)
    assert (text["body"], text["body_encoding"]) == ("plain words", "text")
    binary = by_id["binary-body"]
    assert binary["reason"] == "invalid-body"
    assert binary["body_encoding"] == "base64"
    assert base64.b64decode(binary["body"]) == BINARY

    table = mdb("dlq", "list", settings=settings, env={**backend.env, "COLUMNS": "250"})
    assert table.returncode == 0, table.stderr
    for expected in ("failing", "rolled-back", "text-body", "binary-body",
                     "RuntimeError: poison message 1", "invalid-body"):
        assert expected in table.stdout
    assert "Traceback" not in table.stdout, "the table shows the exception's one line"

    shown = mdb("dlq", "show", "failing", settings=settings, env=backend.env)
    assert shown.returncode == 0, shown.stderr
    assert "Traceback (most recent call last)" in shown.stdout
    assert "RuntimeError: poison message 1" in shown.stdout
    assert "x-mdb-original-destination" in shown.stdout and queue in shown.stdout
    line = one_line_error(mdb("dlq", "show", "no-such-id", settings=settings, env=backend.env), 1)
    assert "no-such-id" in line and dlq in line
    assert backend.probe(settings).count(dlq) == 4, "show consumed nothing"


def test_replay_resets_the_redelivery_count_and_keeps_the_rest_in_order(backend: Backend) -> None:
    queue, dlq, parked = backend.q("IN"), backend.q("DLQ"), backend.q("PARKED")
    settings = work_settings(backend, queue)
    keys = backend.metadata.tables[
        f"{backend.schema}.unique_keys" if backend.schema else "unique_keys"
    ]
    with backend.engine.begin() as conn:  # the data fault that makes "data-bound" fail at commit
        conn.execute(keys.insert().values(key="always-the-same"))
    with backend.producer(settings) as producer:
        producer.send(queue, {"n": 1, "action": "fail"}, message_id="failing")
        producer.send(queue, {"n": 2, "action": "constraint"}, message_id="data-bound")
        producer.send(queue, "plain words", message_id="text-body")
    with backend.container(settings):
        wait_for(lambda: backend.probe(settings).count(dlq) == 3, what="three backouts")
        assert attempts_of(backend, "data-bound") == [0, 1]

        # Replayed while the fault is still there: a fresh count, so two more deliveries.
        result = mdb("dlq", "replay", "data-bound", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        assert "replayed 1 message(s)" in result.stdout
        wait_for(lambda: attempts_of(backend, "data-bound") == [0, 1, 0, 1], what="two more tries")
        wait_for(lambda: [m["id"] for m in listed(backend, settings)]
                 == ["failing", "text-body", "data-bound"], what="backed out again, at the end")
        again = {m["id"]: m for m in listed(backend, settings)}["data-bound"]
        assert again["redelivery_count"] == 2, "the old failures were not counted again"

        # The fault fixed, the replayed message is handled once, on its first delivery.
        with backend.engine.begin() as conn:
            conn.execute(delete(keys))
        result = mdb("dlq", "replay", "data-bound", "--queue", dlq, settings=settings,
                     env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: backend.effects() == {"data-bound": 1}, what="the replay handled")
        assert attempts_of(backend, "data-bound") == [0, 1, 0, 1, 0]
        assert [m["id"] for m in listed(backend, settings)] == ["failing", "text-body"]

        # An unknown id: the found ones are replayed, then exit 1 naming the missing one.
        result = mdb("dlq", "replay", "text-body", "no-such-id", "--to", parked,
                     settings=settings, env=backend.env)
        assert "no-such-id" in one_line_error(result, 1)
        assert "replayed 1 message(s)" in result.stdout

        result = mdb("dlq", "replay", "--all", "--to", parked, settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        assert "replayed 1 message(s)" in result.stdout
    assert backend.probe(settings).count(dlq) == 0
    moved = backend.probe(settings).take_all(parked)
    assert [m.properties["message_id"] for m in moved] == ["text-body", "failing"]
    for message in moved:
        headers = dict(message.headers or message.properties.get("application_headers") or {})
        assert not [k for k in headers if k.startswith("x-mdb-")], headers
    assert json.loads(moved[1].body) == {"n": 1, "action": "fail"}, "body intact"
    assert moved[0].content_type == "text/plain", "properties intact"


def test_replay_killed_between_confirm_and_ack_duplicates_and_loses_nothing(
    backend: Backend,
) -> None:
    queue, dlq, parked = backend.q("IN"), backend.q("DLQ"), backend.q("PARKED")
    settings = work_settings(backend, queue)
    with backend.producer(settings) as producer:
        for n in range(3):
            producer.send(dlq, {"n": n}, message_id=f"dead-{n}")

    crashed = mdb("dlq", "replay", "--all", "--to", parked, settings=settings,
                  env={**backend.env, "MDB_CRASH_AT": "mid-replay:2"})  # SIGKILL after the 2nd confirm
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    probe = backend.probe(settings)
    wait_for(lambda: probe.count(dlq) == 2, what="the unacknowledged original back on the DLQ")
    assert [m["id"] for m in listed(backend, settings)] == ["dead-1", "dead-2"]
    assert probe.count(parked) == 2

    result = mdb("dlq", "replay", "--all", "--to", parked, settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert "replayed 2 message(s)" in result.stdout
    assert probe.count(dlq) == 0
    copies = Counter(m.properties["message_id"] for m in probe.take_all(parked))
    assert copies == {"dead-0": 1, "dead-1": 2, "dead-2": 1}, "one duplicate, nothing lost"


def test_purge_needs_yes(backend: Backend) -> None:
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    with backend.producer(settings) as producer:
        for n in range(3):
            producer.send(dlq, {"n": n}, message_id=f"dead-{n}")

    line = one_line_error(mdb("dlq", "purge", settings=settings, env=backend.env), 2)
    assert "--yes" in line and dlq in line
    assert backend.probe(settings).count(dlq) == 3, "nothing purged without --yes"

    result = mdb("dlq", "purge", "--yes", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert f"purged 3 message(s) from {dlq}" in result.stdout
    assert backend.probe(settings).count(dlq) == 0

    missing = backend.q("NO-SUCH-QUEUE")
    line = one_line_error(mdb("dlq", "purge", missing, "--yes", settings=settings,
                              env=backend.env), 1)
    assert missing in line


@pytest.mark.parametrize("command", [
    ["dlq", "list"], ["dlq", "show", "some-id"], ["dlq", "replay", "--all"],
    ["dlq", "purge", "--yes"], ["send", "ORDERS", "{}"],
])
def test_unreachable_broker_fails_in_one_line_without_the_password(
    command: list[str], tmp_path: Path,
) -> None:
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "amqp://guest:s3cret@127.0.0.1:1//",
        "database_url": f"sqlite:///{tmp_path / 'container.db'}",
        "connect_timeout": "1s",
    }})
    result = mdb(*command, settings=settings)
    line = one_line_error(result, 1)
    assert "127.0.0.1:1" in line and "not reachable" in line
    assert "s3cret" not in result.stderr + result.stdout


# The spelling of the option is the CLI's; browsing and purging each broker is checked on both
# backends by test_list_and_show_browse_without_consuming and test_purge_needs_yes.
@on_embedded
def test_every_dlq_command_takes_the_queue_as_queue_option(backend: Backend) -> None:
    """``list`` and ``purge`` took the queue as an argument, ``show`` and ``replay`` as --queue:
    now all take --queue, and the argument still works."""
    queue, dlq, other = backend.q("IN"), backend.q("DLQ"), backend.q("OTHER")
    settings = backend.write(ports={"Work": {"destination": queue}},
                             queues={queue: {"backout_queue": other}})
    assert listed(backend, settings, "--queue", other) == []  # declares the backout queue
    with backend.producer(settings) as producer:
        producer.send(dlq, {"n": 0}, message_id="on-dlq")
        producer.send(other, {"n": 1}, message_id="on-other")

    assert [m["id"] for m in listed(backend, settings, "--queue", other)] == ["on-other"]
    assert [m["id"] for m in listed(backend, settings, other)] == ["on-other"]  # the older spelling
    assert [m["id"] for m in listed(backend, settings)] == ["on-dlq"]  # default: dead_letter_queue
    result = mdb("dlq", "purge", "--queue", other, "--yes", settings=settings, env=backend.env)
    assert f"purged 1 message(s) from {other}" in result.stdout, result.stderr
    result = mdb("dlq", "purge", dlq, "--yes", settings=settings, env=backend.env)
    assert f"purged 1 message(s) from {dlq}" in result.stdout, result.stderr


def backed_out_by_hand(backend: Backend, settings: Path, dlq: str, count: int,
                       big: int = 0) -> list[str]:
    """``count`` messages on the DLQ as the container leaves them (the last with a ``big`` body)."""
    ids = [f"{uuid.uuid4()}" for _ in range(count)]
    with backend.producer(settings) as producer:
        for n, mid in enumerate(ids):
            body = {"n": n, "blob": "x" * (big if n == count - 1 else 10)}
            producer.send(dlq, body, message_id=mid, headers={
                "x-mdb-original-destination": "orders.incoming.from.the.web.shop", "x-mdb-port": "Work",
                "x-mdb-backout-reason": "backout-threshold", "x-mdb-redelivery-count": 5,
                "x-mdb-failed-at": "2026-11-30T20:40:53.97+00:00",
                "x-mdb-exception": "Traceback ...\nRuntimeError: poison message with a long story to tell",
            })
    return ids


# The table's layout and --limit are the CLI's; browsing without consuming on each broker is
# test_list_and_show_browse_without_consuming's, on both backends.
@on_embedded
def test_list_fits_80_columns_and_stops_at_its_limit(backend: Backend) -> None:
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    ids = backed_out_by_hand(backend, settings, dlq, 5)

    table = mdb("dlq", "list", settings=settings, env={**backend.env, "COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0] == f"{dlq}: 5 message(s)"
    assert lines[1].startswith("id "), "a title, a header, then one line per message"
    rows = [line for line in lines[2:] if not line.startswith(" ")]
    assert [line.split()[0] for line in rows] == ids, "ids whole, to copy into dlq show"
    assert all(len(line) <= 80 for line in lines), table.stdout
    assert "…" not in table.stdout, "reason and exception whole, on a second line where needed"
    assert "exception: RuntimeError: poison message with a long story to tell" in table.stdout

    first = mdb("dlq", "list", "--limit", "2", "--json", settings=settings, env=backend.env)
    assert [m["id"] for m in json.loads(first.stdout)] == ids[:2]
    assert f"{dlq}: the first 2 of 5 message(s) shown (--limit N shows more)" in first.stderr
    every = mdb("dlq", "list", "--limit", "0", "--json", settings=settings, env=backend.env)
    assert [m["id"] for m in json.loads(every.stdout)] == ids
    assert backend.probe(settings).count(dlq) == 5, "every message stays, the unshown too"


# Cutting a long body is the CLI's drawing; the body as each broker keeps it is
# test_show_prints_the_body_as_it_was_sent's, on both backends.
@on_embedded
def test_show_cuts_a_big_body_unless_full(backend: Backend) -> None:
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    [mid] = backed_out_by_hand(backend, settings, dlq, 1, big=200_000)

    shown = mdb("dlq", "show", mid, settings=settings, env=backend.env)
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout) < 4000
    assert "RuntimeError: poison message with a long story to tell" in shown.stdout
    assert re.search(r"body \(json, 200,0\d\d bytes\): \{.*… \([\d,]+ more characters: --full shows them\)",
                     shown.stdout)
    full = mdb("dlq", "show", mid, "--full", settings=settings, env=backend.env)
    assert '"x' + "x" * 199_999 + '"' in full.stdout
    assert "--full shows them" not in full.stdout


def test_a_message_the_handler_moved_is_handled_again_when_replayed(backend: Backend) -> None:
    """``ctx.move_to`` counts as handled, so the dedup row of the message
    commits with the move; ``mdb dlq replay`` must still bring the message back to its
    handler, not have it acknowledged as a duplicate of the delivery that moved it."""
    queue, dlq = backend.q("Q"), backend.q("DLQ")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    with backend.container(settings):
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "move", "to": dlq}, message_id="parked")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="the move")
        result = mdb("dlq", "replay", "parked", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: len([a for a in backend.attempts() if a[1] == "parked"]) == 2,
                 what="the replayed copy to reach the handler")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="moved again")


def test_a_replay_killed_mid_way_and_run_again_still_applies_a_backed_out_message_once(
    backend: Backend,
) -> None:
    """The replay's crash window (confirmed copy, original not yet acknowledged) duplicates the
    copy; the dedup row of the first copy must absorb the second (README, dlq.py)."""
    queue, dlq = backend.q("Q"), backend.q("DLQ")
    settings = backend.write(ports={"Work": {"destination": queue, "max_retries": 5}},
                             queues={queue: {"backout_threshold": 1}})
    keys = backend.metadata.tables[f"{backend.schema}.unique_keys" if backend.schema
                                   else "unique_keys"]
    with backend.engine.begin() as conn:  # the data fault that makes the message fail at commit
        conn.execute(keys.insert().values(key="always-the-same"))
    with backend.container(settings):
        with backend.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "constraint"}, message_id="m")
        wait_for(lambda: backend.probe(settings).count(dlq) == 1, what="the backout")
        with backend.engine.begin() as conn:
            conn.execute(keys.delete())
        crashed = mdb("dlq", "replay", "m", settings=settings,
                      env={**backend.env, "MDB_CRASH_AT": "mid-replay"})
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        wait_for(lambda: backend.effects() == {"m": 1}, what="the first copy handled")
        result = mdb("dlq", "replay", "m", settings=settings, env=backend.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: backend.probe(settings).count(queue) == 0 and
                 len([a for a in backend.attempts() if a[1] == "m"]) >= 2,
                 what="the second copy consumed")
        wait_for(lambda: backend.probe(settings).count(dlq) == 0, what="the DLQ empty")
    assert backend.effects() == {"m": 1}


def test_a_replay_killed_mid_way_and_run_again_applies_a_moved_message_once_more_not_twice(
    rabbit: Backend,
) -> None:
    """A message the handler moved (``ctx.move_to``) committed its work and dedup row; its replay
    forgets that row so the copy is handled again. Killed between the confirm and the ack, the
    replay is run again: the row the first copy committed must absorb the second copy."""
    queue, dlq = rabbit.q("Q"), rabbit.q("DLQ")
    flag = rabbit.tmp / "park-it"
    flag.touch()
    settings = rabbit.write(ports={"Work": {"destination": queue, "max_retries": 5}})
    with rabbit.container(settings) as container:
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "move", "to": dlq, "while": str(flag)},
                          message_id="parked")
        wait_for(lambda: rabbit.probe(settings).count(dlq) == 1, what="the move")
        assert rabbit.effects() == {"parked": 1}
        flag.unlink()  # the operator fixed what made the handler park it
        crashed = mdb("dlq", "replay", "parked", settings=settings,
                      env={**rabbit.env, "MDB_CRASH_AT": "mid-replay"})
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr
        wait_for(lambda: rabbit.effects() == {"parked": 2}, what="the replayed copy applied")
        result = mdb("dlq", "replay", "parked", settings=settings, env=rabbit.env)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: rabbit.probe(settings).count(dlq) == 0, what="the DLQ empty")
        wait_for(lambda: (container.port_state("Work") or {}).get("delivered", 0) >= 3
                 and rabbit.probe(settings).count(queue) == 0, what="the second copy consumed")
        row = container.port_state("Work") or {}
    assert rabbit.effects() == {"parked": 2}, "one replay applied the message once, however often run"
    assert row.get("duplicate_skipped") == 1, row


def test_a_replay_that_stops_on_an_error_part_way_is_in_the_history(rabbit: Backend) -> None:
    """``mdb dlq replay --all`` moves the dead-letter queue's messages, then cannot declare the next
    backout queue (it exists with other arguments): what was replayed is in the history."""
    queue, dlq, other = rabbit.q("IN"), rabbit.q("DLQ"), rabbit.q("OTHER-BACKOUT")
    settings = rabbit.write(ports={"Work": {"destination": queue}},
                            queues={rabbit.q("ELSE"): {"backout_queue": other}})
    assert rabbit.settings(settings).backout_queues() == [dlq, other]
    with rabbit.producer(settings) as producer:
        for mid in ("r-1", "r-2"):
            producer.send(dlq, {"n": 1}, message_id=mid, headers={"x-mdb-original-destination": queue})
    conn = rabbit.probe(settings).broker.connect()
    try:  # the queue someone made by hand, with arguments the settings do not give it
        conn.channel().queue_declare(queue=other, durable=True, arguments={"x-max-length": 7})
    finally:
        conn.close()
    line = one_line_error(mdb("dlq", "replay", "--all", settings=settings, env=rabbit.env), 1)
    assert other in line and "cannot be declared" in line, line
    assert rabbit.probe(settings).count(queue) == 2, "the first queue's messages were replayed"
    store = Store(rabbit.settings(settings).container)
    try:
        actions = History(store).newest()
    finally:
        store.dispose()
    assert [(a.action, a.detail.split(";")[0]) for a in actions] == [
        ("replay", "replayed 2 message(s) (all)")], actions
    assert other in actions[0].detail, "the history says where it stopped"


# The warning reads the backout reasons in the headers; replaying on each broker is
# test_replay_resets_the_redelivery_count_and_keeps_the_rest_in_order's, on both backends.
@on_embedded
def test_replay_warns_that_invalid_bodies_come_straight_back(backend: Backend) -> None:
    """An invalid body replayed as it is fails validation again: the replay says which ones."""
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    with backend.producer(settings) as producer:
        for mid, reason in (("poison", "backout-threshold"), ("bad-1", "invalid-body"),
                            ("bad-2", "invalid-body")):
            producer.send(dlq, {"n": 1}, message_id=mid, headers={
                "x-mdb-original-destination": backend.q("PARKED"), "x-mdb-backout-reason": reason})
    result = mdb("dlq", "replay", "--all", settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "replayed 3 message(s)"
    warning = result.stderr.strip()
    assert warning.startswith("warning: 2 of them are invalid bodies (invalid-body: bad-1, bad-2)")
    assert "mdb send DEST @fixed.json --id ID" in warning and "mdb dlq purge" in warning


def test_show_prints_the_body_as_it_was_sent(backend: Backend) -> None:
    """``19 bytes`` and the 19 characters sent, not JSON re-spaced to 20."""
    queue, dlq = backend.q("IN"), backend.q("DLQ")
    settings = work_settings(backend, queue)
    sent = '{"a":1,  "b": "x"}'
    publish_raw(backend, settings, dlq, "as-sent", sent.encode(), "application/json")
    result = mdb("dlq", "show", "as-sent", "--queue", dlq, settings=settings, env=backend.env)
    assert result.returncode == 0, result.stderr
    assert f"body (json, {len(sent)} bytes): {sent}\n" in result.stdout, result.stdout


def test_list_shows_the_exception_line_whole() -> None:
    """The table's second line carries the exception; it is not cut to a fixed 72 characters."""
    from mdbcontainer.operations.dlq import BackedOutMessage

    last = "InvalidBody: amount: Input should be a valid number, unable to parse string as a number " \
           "[type=float_parsing, input_value='lots', input_type=str]"
    letter = BackedOutMessage(queue="DLQ", id="bad-1", headers={"x-mdb-exception": f"Traceback ...\n{last}"},
                        properties={}, body=b"{}", content_type="application/json")
    assert letter.summary() == last
