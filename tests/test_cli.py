"""The ``mdb`` command as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mdbcontainer.testing import write_settings
from tests.conftest import ROOT


def mdb(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mdbcontainer", *args], capture_output=True, text=True,
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=60,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


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
    result = mdb("check", "-c", str(good))
    assert result.returncode == 0, result.stderr
    assert "ok: 1 port(s) (Work)" in result.stdout


def test_check_warns_about_risky_poison_settings(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d"},
        "queues": {"WORK": {"backout_threshold": 0}},
        "ports": {"Work": {"destination": "WORK"}},
    })
    result = mdb("check", "-c", str(path))
    assert result.returncode == 0
    assert "backout_threshold = 0 never backs a message out" in result.stderr
    path.write_text(path.read_text().replace("backout_threshold = 0", "backout_threshold = 5"))
    result = mdb("check", "-c", str(path))
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
        result = mdb(*command, "-c", str(path))
        assert result.returncode == 2, (command, result.stderr)
        line = one_line_error(result)
        assert expected in line
        assert str(path) in line or "listener module" in line


def test_listener_that_fails_inside_its_import_is_told_apart(tmp_path: Path) -> None:
    (tmp_path / "broken_listener.py").write_text("import no_such_dependency\n")
    path = write_settings(tmp_path / "settings.toml", {"container": {"listeners": ["broken_listener"]}})
    line = one_line_error(mdb("check", "-c", str(path), cwd=tmp_path))
    assert "listener module 'broken_listener' failed to import" in line
    assert "no_such_dependency" in line


def test_send_rejects_a_body_that_is_not_json(good: Path) -> None:
    result = mdb("send", "WORK", "{not json", "-c", str(good))
    assert result.returncode == 2
    assert "BODY is not JSON" in one_line_error(result)


def test_send_rejects_bad_options(good: Path) -> None:
    assert mdb("send", "WORK", "{}", "--priority", "12", "-c", str(good)).returncode == 2
    result = mdb("send", "WORK", "{}", "--ttl", "soon", "-c", str(good))
    assert result.returncode == 2 and "--ttl" in one_line_error(result)
    result = mdb("send", "WORK", "{}", "-H", "novalue", "-c", str(good))
    assert result.returncode == 2 and "key=value" in one_line_error(result)


def test_send_reads_body_from_file_and_prints_ids(good: Path, tmp_path: Path) -> None:
    (tmp_path / "body.json").write_text('{"n": 1}')
    result = mdb("send", "WORK", "@" + str(tmp_path / "body.json"), "--id", "m", "--count", "3",
                 "-c", str(good))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["m-1", "m-2", "m-3"]


def test_unreachable_broker_is_exit_1_without_the_password(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "amqp://guest:topsecret@127.0.0.1:1//", "connect_timeout": "1s",
        "listeners": [],
    }})
    result = mdb("send", "Q", "{}", "-c", str(path))
    assert result.returncode == 1
    line = one_line_error(result)
    assert "not reachable within 1s" in line
    assert "topsecret" not in result.stderr + result.stdout


def test_help_explains_each_option() -> None:
    result = mdb("send", "--help")
    assert result.returncode == 0
    for option in ("--priority", "--ttl", "--non-persistent", "--id", "--header", "--reply-to",
                   "--correlation-id", "--count"):
        assert option in result.stdout


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
    result = mdb("check", "-c", str(path))
    assert result.returncode == 2
    assert "ports.Work.acknowledge: 'transacted' needs AMQP channel transactions" in one_line_error(result)


def test_license_is_the_spdx_string_setuptools_asks_for() -> None:
    """A license table makes every ``pip install`` print a deprecation warning (setuptools >= 77)."""
    import re
    import tomllib

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", setuptools)
    assert minimum and int(minimum.group(1)) >= 77, "SPDX strings need setuptools >= 77"


def every_command_path() -> list[list[str]]:
    """``[]``, ``["run"]``, ``["dlq"]``, ``["dlq", "list"]``...: every command and group of ``mdb``."""
    import typer.main

    from mdbcontainer.cli import app

    def walk(command: object, path: list[str]) -> list[list[str]]:
        found = [path]
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            found += walk(sub, [*path, name])
        return found

    return walk(typer.main.get_command(app), [])


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = mdb("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"mdb (mdbcontainer) {version('mdbcontainer')}"


def test_dash_h_is_help_on_every_command() -> None:
    from typer.testing import CliRunner

    from mdbcontainer.cli import app

    runner = CliRunner()
    paths = every_command_path()
    assert ["dlq", "list"] in paths and ["port", "start"] in paths  # the walk reaches subcommands
    for path in paths:
        short = runner.invoke(app, [*path, "-h"], prog_name="mdb", terminal_width=100)
        long = runner.invoke(app, [*path, "--help"], prog_name="mdb", terminal_width=100)
        assert short.exit_code == 0, (path, short.output)
        assert "Usage: mdb" in short.output
        assert short.output == long.output, path
