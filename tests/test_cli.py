"""The ``mdb`` command as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kombu
import pytest

from mdbcontainer.testing import mdb, write_settings
from tests.conftest import CHILD_ENV, RABBITMQ_URL, Backend, one_line_error


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_settings(tmp_path / "settings.toml", {
        "container": {
            "broker_url": f"embedded://{tmp_path / 'broker.db'}",
            "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
            "listeners": ["tests.apps.work"],
        },
        "ports": {"Work": {"destination": "WORK", "max_retries": 5}},
    })


def test_check_accepts_good_settings(good: Path) -> None:
    result = mdb("check", settings=good, env=CHILD_ENV)
    assert result.returncode == 0, result.stderr
    assert "ok: 1 port(s) (Work)" in result.stdout


def test_check_warns_about_risky_poison_settings(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d"},
        "queues": {"WORK": {"backout_threshold": 0}},
        "ports": {"Work": {"destination": "WORK"}},
    })
    result = mdb("check", settings=path, env=CHILD_ENV)
    assert result.returncode == 0
    assert "backout_threshold = 0 never backs a message out" in result.stderr
    path.write_text(path.read_text().replace("backout_threshold = 0", "backout_threshold = 5"))
    result = mdb("check", settings=path, env=CHILD_ENV)
    assert "max_retries = 0 < backout_threshold = 5: the port stops before" in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[container\n", "invalid TOML"),
        ('[container]\nlisteners = ["tests.apps.work"]\n[ports.Work]\ndestination = "Q"\nmax_retry = 1\n',
         "ports.Work.max_retry: unknown key 'max_retry'. Did you mean 'max_retries'?"),
        ('[container]\nlisteners = ["tests.apps.work"]\n[ports.Work]\ndestination = "Q"\nprefetch = "x"\n',
         "ports.Work.prefetch: Input should be a valid integer"),
        ('[container]\nlisteners = ["listeners.nope"]\n', "listener module 'listeners.nope' not found"),
        ('[container]\nlisteners = ["tests.apps.work"]\n[ports.Work]\ndestination = "Q"\n'
         '[ports.Other]\ndestination = "R"\n', "ports.Other: no handler"),
    ],
    ids=["malformed-toml", "unknown-key", "wrong-type", "missing-listener", "port-without-handler"],
)
def test_bad_settings_exit_2_with_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    for command in (["check"], ["run"]):
        result = mdb(*command, settings=path, env=CHILD_ENV)
        assert result.returncode == 2, (command, result.stderr)
        line = one_line_error(result)
        assert expected in line
        assert str(path) in line or "listener module" in line


def test_listener_that_fails_inside_its_import_is_told_apart(tmp_path: Path) -> None:
    (tmp_path / "broken_listener.py").write_text("import no_such_dependency\n")
    path = write_settings(tmp_path / "settings.toml", {"container": {"listeners": ["broken_listener"]}})
    line = one_line_error(mdb("check", settings=path, env=CHILD_ENV))
    assert "listener module 'broken_listener' failed to import" in line
    assert "no_such_dependency" in line


def test_send_rejects_a_body_that_is_not_json(good: Path) -> None:
    result = mdb("send", "WORK", "{not json", settings=good, env=CHILD_ENV)
    assert result.returncode == 2
    assert "BODY is not JSON" in one_line_error(result)


def test_send_rejects_bad_options(good: Path) -> None:
    assert mdb("send", "WORK", "{}", "--priority", "12", settings=good, env=CHILD_ENV).returncode == 2
    result = mdb("send", "WORK", "{}", "--ttl", "soon", settings=good, env=CHILD_ENV)
    assert result.returncode == 2 and "--ttl" in one_line_error(result)
    result = mdb("send", "WORK", "{}", "-H", "novalue", settings=good, env=CHILD_ENV)
    assert result.returncode == 2 and "key=value" in one_line_error(result)


def test_send_reads_body_from_file_and_prints_ids(good: Path, tmp_path: Path) -> None:
    (tmp_path / "body.json").write_text('{"n": 1}')
    result = mdb("send", "WORK", "@" + str(tmp_path / "body.json"), "--id", "m", "--count", "3",
                 settings=good, env=CHILD_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["m-1", "m-2", "m-3"]


def test_unreachable_broker_is_exit_1_without_the_password(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "amqp://guest:topsecret@127.0.0.1:1//", "connect_timeout": "1s",
        "listeners": [],
    }})
    result = mdb("send", "Q", "{}", settings=path, env=CHILD_ENV)
    assert result.returncode == 1
    line = one_line_error(result)
    assert "not reachable within 1s" in line
    assert "topsecret" not in result.stderr + result.stdout


def commands() -> list[tuple[list[str], Any]]:
    """Every command of ``mdb`` (``dlq replay`` is ``["dlq", "replay"]``) with its click command."""
    import typer.main

    from mdbcontainer.cli import app

    found, groups = [], [([], typer.main.get_command(app))]
    while groups:
        path, group = groups.pop()
        for name, command in getattr(group, "commands", {}).items():
            if hasattr(command, "commands"):
                groups.append(([*path, name], command))
            else:
                found.append(([*path, name], command))
    return found


def test_help_explains_each_option() -> None:
    """``mdb COMMAND --help`` says what the command does and what each option and argument means.

    typer lists an option's name even when nobody wrote its help, so the row of each one must
    carry its own explanation.
    """
    from typer.testing import CliRunner

    from mdbcontainer.cli import app

    found = commands()
    assert {" ".join(path) for path, _ in found} >= {"run", "check", "send", "ports", "request",
                                                     "dlq replay", "port stop", "dedup purge"}
    for path, command in found:
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
        assert shown.exit_code == 0, shown.output
        assert command.help and command.help.splitlines()[0] in shown.output, path
        rows = shown.output.splitlines()
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            names = [*param.opts, param.metavar or ""]
            assert param.help, f"mdb {' '.join(path)} {names[-2]}: no help text"
            row = next((r for r in rows if param.help.split(". ")[0] in r), "")
            assert any(name and f" {name} " in row for name in names), (path, names, shown.output)


def test_public_api_is_pinned() -> None:
    import mdbcontainer

    assert sorted(mdbcontainer.__all__) == sorted([
        "BrokerError", "BrokerUnavailable", "ListenerError", "MdbError", "Message",
        "MessageContext", "Producer", "PublishError", "RequestTimeout", "Settings",
        "SettingsError", "TransactionError", "Unroutable", "load_settings", "message_driven",
    ])


def test_check_refuses_a_mode_the_embedded_broker_cannot_provide(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "settings.toml", {
        "container": {"broker_url": f"embedded://{tmp_path / 'b.db'}", "listeners": ["tests.apps.work"],
                      "database_url": f"sqlite:///{tmp_path / 'd.db'}"},
        "ports": {"Work": {"destination": "W", "transaction": "none", "acknowledge": "transacted"}},
    })
    result = mdb("check", settings=path, env=CHILD_ENV)
    assert result.returncode == 2
    assert "ports.Work.acknowledge: 'transacted' needs AMQP channel transactions" in one_line_error(result)


@pytest.mark.rabbitmq
def test_a_refused_login_is_one_line_exit_1_without_the_password(rabbit: Backend) -> None:
    """Contract 5: a broker that cannot be reached is exit 1 and one line; a wrong password too."""
    bad = RABBITMQ_URL.replace("guest:guest", "guest:s3cret-pw")
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}}, broker_url=bad,
                            connect_timeout="2s")
    for args in (("send", rabbit.q("Q"), "{}"), ("dlq", "list")):
        result = mdb(*args, settings=settings, env=rabbit.env)
        line = one_line_error(result)
        assert result.returncode == 1, result.stderr
        assert "s3cret-pw" not in result.stderr + result.stdout
        assert "ACCESS_REFUSED" in line and "guest:***@" in line


@pytest.mark.rabbitmq
def test_a_queue_declare_the_broker_refuses_is_one_line_exit_1(rabbit: Backend) -> None:
    """A queue that exists with other arguments (PRECONDITION_FAILED) is a reported failure."""
    queue = rabbit.q("PRIO")
    with kombu.Connection(RABBITMQ_URL) as conn:
        conn.channel().queue_declare(queue=queue, durable=True, auto_delete=False,
                                     arguments={"x-max-priority": 5})
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}})
    result = mdb("send", queue, "{}", settings=settings, env=rabbit.env)
    line = one_line_error(result)
    assert result.returncode == 1
    assert queue in line and "PRECONDITION_FAILED" in line


def test_an_unknown_port_name_is_bad_usage_exit_2(tmp_path: Path) -> None:
    """Contract 5: exit 2 for a bad argument, as ``mdb run --port NAME`` already does."""
    settings = write_settings(tmp_path / "settings.toml", {
        "container": {
            "broker_url": f"embedded://{tmp_path / 'broker.db'}",
            "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
            "listeners": ["tests.apps.work"],
        },
        "ports": {"Work": {"destination": "WORK"}},
    })
    for verb in ("start", "stop"):
        result = mdb("port", verb, "Wrok", settings=settings, env=CHILD_ENV)
        line = one_line_error(result)
        assert result.returncode == 2, result.stderr
        assert "'Wrok'" in line and "Work" in line


def test_a_ttl_that_is_not_positive_is_bad_usage_exit_2(tmp_path: Path) -> None:
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
    }})
    result = mdb("send", "Q", "{}", "--ttl", "0s", settings=settings, env=CHILD_ENV)
    line = one_line_error(result)
    assert result.returncode == 2
    assert "--ttl" in line
