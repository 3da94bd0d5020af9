"""The ``mdb`` command as a user runs it: exit codes and one-line errors."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kombu
import pytest

from mdbcontainer.settings import load_settings
from mdbcontainer.testing import mdb, write_settings
from tests.conftest import CHILD_ENV, POSTGRES_URL, RABBITMQ_URL, ROOT, Backend, mdb_here, one_line_error


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
    result = mdb_here("check", settings=good)
    assert result.returncode == 0, result.stderr
    assert "ok: 1 port(s) (Work)" in result.stdout


def test_check_warns_about_risky_poison_settings(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d"},
        "queues": {"WORK": {"backout_threshold": 0}},
        "ports": {"Work": {"destination": "WORK"}},
    })
    result = mdb_here("check", settings=path)
    assert result.returncode == 0
    assert "backout_threshold = 0 never backs a message out" in result.stderr
    path.write_text(path.read_text().replace("backout_threshold = 0", "backout_threshold = 5"))
    result = mdb_here("check", settings=path)
    assert "max_retries = 0 < backout_threshold = 5: the port stops before" in result.stderr
    assert "(0 and 5 are the defaults, WebSphere's; docs/guides/poison-messages.md: Settings for a new service)" in result.stderr


def test_the_guides_settings_for_a_new_service_check_without_a_warning(tmp_path: Path) -> None:
    """The defaults warn (WebSphere's 0 and 5 stop a port at each poison message); what the
    poison-messages guide recommends for a new service does not."""
    guide = (ROOT / "docs" / "guides" / "poison-messages.md").read_text()
    section = guide.split("## Settings for a new service", 1)[1].split("\n## ", 1)[0]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    toml = toml.replace('"amqp://app:SECRET@mq1//"', f'"embedded://{tmp_path}/b.db"')
    toml = toml.replace('"postgresql+psycopg://app:SECRET@db/orders"', f'"sqlite:///{tmp_path}/d.db"')
    toml = toml.replace('["app.listeners"]', '["tests.apps.work"]')
    toml = "\n".join(line for line in toml.splitlines() if not line.startswith("metadata ="))
    toml = toml.replace("[ports.PaymentsPort]", "[ports.Work]")
    path = tmp_path / "settings.toml"
    path.write_text(toml)
    result = mdb_here("check", settings=path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and "warning" not in result.stdout, result.stderr


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
        result = mdb_here(*command, settings=path)
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


def test_send_reads_body_from_file_and_prints_ids(good: Path, tmp_path: Path) -> None:
    (tmp_path / "body.json").write_text('{"n": 1}')
    result = mdb("send", "WORK", "@" + str(tmp_path / "body.json"), "--id", "m", "--count", "3",
                 settings=good, env=CHILD_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["m-1", "m-2", "m-3"]


def test_send_lines_sends_one_distinct_message_per_json_line(backend: Backend) -> None:
    """``mdb send Q @orders.jsonl --lines``: many distinct messages from the command line."""
    queue = backend.q("ORDERS")
    settings = backend.write(ports={"Work": {"destination": queue}}, queues={queue: {}})
    orders = backend.tmp / "orders.jsonl"
    orders.write_text('{"order_id": 1}\n\n{"order_id": 2}\n{"order_id": 3}\n')
    result = mdb("send", queue, f"@{orders}", "--lines", "--id", "order", settings=settings,
                 env=backend.env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["order-1", "order-2", "order-3"]
    taken = backend.probe(settings).take_all(queue)
    assert [json.loads(m.body) for m in taken] == [{"order_id": n} for n in (1, 2, 3)]


def test_send_lines_sends_nothing_when_a_line_is_not_json(good: Path, tmp_path: Path) -> None:
    orders = tmp_path / "orders.jsonl"
    orders.write_text('{"order_id": 1}\n{"order_id": 2,}\n')
    result = mdb_here("send", "WORK", f"@{orders}", "--lines", settings=good)
    assert result.returncode == 2 and result.stdout == ""
    assert f"{orders}:2 is not JSON" in one_line_error(result) and "nothing was sent" in result.stderr
    for args in (("{}", "--lines"), (f"@{orders}", "--lines", "--count", "2")):
        result = mdb_here("send", "WORK", *args, settings=good)
        assert result.returncode == 2, args


def test_send_does_not_pay_for_the_database_layer(tmp_path: Path) -> None:
    """One ``mdb send`` imports neither SQLAlchemy nor the handler machinery: they were most of
    its 0.45 s. The public names still import on first use."""
    body = tmp_path / "b.json"
    body.write_text("{}")
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": "sqlite:///relative/container.db", "listeners": []}})
    script = ("import sys; from mdbcontainer.cli.main import main; sys.argv = ['mdb'] + sys.argv[1:]\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "print(sorted(m for m in ('sqlalchemy', 'mdbcontainer.units.context', 'mdbcontainer.pipeline.single')"
              " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, "send", "Q", f"@{body}", "-c", str(settings)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **CHILD_ENV})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout
    import mdbcontainer

    assert mdbcontainer.MessageContext.__name__ == "MessageContext"
    assert load_settings(settings, environ={}).container.database_url == (
        f"sqlite:///{tmp_path / 'relative/container.db'}"), "relative to the settings file, as before"


def test_unreachable_broker_is_exit_1_without_the_password(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "amqp://guest:topsecret@127.0.0.1:1//", "connect_timeout": "1s",
        "listeners": [],
    }})
    result = mdb_here("send", "Q", "{}", settings=path)
    assert result.returncode == 1
    line = one_line_error(result)
    assert "not reachable within 1s" in line
    assert "topsecret" not in result.stderr + result.stdout


def commands() -> list[tuple[list[str], Any]]:
    """Every command of ``mdb`` (``dlq replay`` is ``["dlq", "replay"]``) with its click command."""
    import typer.main

    from mdbcontainer.cli.main import app

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

    from mdbcontainer.cli.main import app

    found = commands()
    assert {" ".join(path) for path, _ in found} >= {"run", "check", "send", "ports", "request",
                                                     "dlq replay", "port stop", "dedup purge"}
    for path, command in found:
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
        assert shown.exit_code == 0, shown.output
        assert command.help and " ".join(command.help.split()[:4]) in shown.output, path
        rows = shown.output.splitlines()
        for param in command.params:
            if getattr(param, "hidden", False):
                continue
            names = [*param.opts, param.metavar or ""]
            assert param.help, f"mdb {' '.join(path)} {names[-2]}: no help text"
            start = " ".join(param.help.split()[:3])  # help wraps at 80 columns: its first words
            row = next((r for r in rows if start in r), "")
            assert any(name and f" {name} " in row for name in names), (path, names, shown.output)


def test_help_explains_every_option_in_one_style() -> None:
    """Every argument and option says what it is for; placeholders are UPPERCASE; flags take none."""
    import typer.main
    from typer.testing import CliRunner

    from mdbcontainer.cli.main import app

    root = typer.main.get_command(app)
    runner = CliRunner()
    for path in every_command_path():
        command: Any = root
        for name in path:
            command = command.commands[name]
        for param in command.params:
            if param.hidden or param.name == "help":
                continue
            assert param.help, (path, param.name)  # documented, --correlation-id and NAME included
            if getattr(param, "is_flag", False):
                assert param.metavar is None, (path, param.name)
            else:
                assert re.fullmatch(r"[A-Z][A-Z_]*(=[A-Z]+)?", param.metavar or ""), (path, param.name)
        shown = runner.invoke(app, [*path, "-h"], prog_name="mdb", terminal_width=80).output
        assert not re.search(r"<(str|bool|int|path|list)", shown), (path, shown)  # no type labels
        assert not re.search(r"\{[a-z]", shown), (path, shown)  # no {destination} beside {ID}
        assert all(len(line) <= 80 for line in shown.splitlines()), (path, shown)


def test_send_help_names_each_option_with_its_placeholder() -> None:
    result = mdb("send", "-h", env=CHILD_ENV)
    assert result.returncode == 0
    assert "Usage: mdb send [OPTIONS] {DEST} {BODY}" in result.stdout
    for option in ("--priority N", "--ttl DURATION", "--id ID", "-H, --header KEY=VALUE",
                   "--reply-to QUEUE", "--correlation-id ID", "--count N", "--lines"):
        assert option in result.stdout
    assert re.search(r"^  --non-persistent {2,}Keep it", result.stdout, re.M)  # a flag: no placeholder


def test_ports_help_says_the_counts_start_with_each_container() -> None:
    result = mdb("ports", "-h", env=CHILD_ENV)
    assert "counts (each since its container started)" in " ".join(result.stdout.split())


def test_check_refuses_a_mode_the_embedded_broker_cannot_provide(tmp_path: Path) -> None:
    path = write_settings(tmp_path / "settings.toml", {
        "container": {"broker_url": f"embedded://{tmp_path / 'b.db'}", "listeners": ["tests.apps.work"],
                      "database_url": f"sqlite:///{tmp_path / 'd.db'}"},
        "ports": {"Work": {"destination": "W", "transaction": "none", "acknowledge": "transacted"}},
    })
    result = mdb_here("check", settings=path)
    assert result.returncode == 2
    assert "ports.Work.acknowledge: 'transacted' needs AMQP channel transactions" in one_line_error(result)


@pytest.mark.rabbitmq
def test_a_refused_login_is_one_line_exit_1_without_the_password(rabbit: Backend) -> None:
    """The CLI's exit codes (README: *The mdb command*): a broker that cannot be reached is exit 1 and one line; a wrong password too."""
    bad = RABBITMQ_URL.replace("guest:guest", "guest:s3cret-pw")
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}}, broker_url=bad,
                            connect_timeout="2s")
    for args in (("send", rabbit.q("Q"), "{}"), ("dlq", "list")):
        result = mdb(*args, settings=settings, env=rabbit.env)
        line = one_line_error(result)
        assert result.returncode == 1, result.stderr
        assert "s3cret-pw" not in result.stderr + result.stdout
        assert "ACCESS_REFUSED" in line and "guest:***@" in line


REFUSED_SETTINGS = [
    pytest.param("broker_url", RABBITMQ_URL.replace("guest:guest", "guest:s3cret-pw"),
                 "ACCESS_REFUSED", id="wrong-password"),
    pytest.param("broker_url", RABBITMQ_URL.replace("guest:guest", "nobody-mdb:s3cret-pw"),
                 "ACCESS_REFUSED", id="unknown-user"),
    pytest.param("broker_url", RABBITMQ_URL.rstrip("/") + "/no-such-vhost-mdb", "NOT_ALLOWED",
                 id="unknown-vhost"),
    pytest.param("database_url", POSTGRES_URL.replace("/test", "/no_such_db_mdb"),
                 'database "no_such_db_mdb" does not exist', id="unknown-database"),
    pytest.param("database_url", POSTGRES_URL.replace("postgres@", "no_such_role_mdb:s3cret-pw@"),
                 'role "no_such_role_mdb" does not exist', id="unknown-role"),
]


@pytest.mark.rabbitmq
@pytest.mark.postgres
@pytest.mark.parametrize(("key", "url", "said"), REFUSED_SETTINGS)
def test_check_and_run_exit_2_on_a_service_that_refuses_the_settings(
        rabbit: Backend, key: str, url: str, said: str) -> None:
    """A wrong login, vhost or database is no outage: waiting cannot fix it. ``mdb check`` (a
    deployment's pre-start step) and ``mdb run`` exit 2 with one line naming the setting."""
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q"), "max_retries": 5}},
                            **{key: url})
    for args in (("check",), ("run",), ("run", "--processes", "2")):
        # ``mdb check`` in this process (the same one line, without a Python start-up); the runs as processes.
        result = (mdb_here(*args, settings=settings, env=rabbit.env) if args == ("check",)
                  else mdb(*args, settings=settings, env=rabbit.env, timeout=30))
        line = one_line_error(result)
        assert result.returncode == 2, (args, result.stderr)
        assert line.startswith(f"mdb: error: container.{key}: ") and said in line, line
        assert "s3cret-pw" not in result.stderr + result.stdout


def test_check_warns_about_a_service_that_is_down_and_run_waits_for_it(tmp_path: Path) -> None:
    """A broker or database that is down may come up: a warning, not an error, from ``mdb check``."""
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "broker_url": "amqp://guest:guest@127.0.0.1:1//",
                      "database_url": "postgresql+psycopg://postgres@127.0.0.1:1/test"},
        "ports": {"Work": {"destination": "WORK", "max_retries": 5}},
    })
    result = mdb_here("check", settings=path)
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.splitlines()
    assert [w.split(" not reachable")[0] for w in warnings] == [
        "warning: broker amqp://guest:***@127.0.0.1:1//",
        "warning: database postgresql+psycopg://postgres@127.0.0.1:1/test"]
    assert all(w.endswith("mdb run waits for it") for w in warnings), warnings
    assert "2 warning(s)" in result.stdout


@pytest.mark.rabbitmq
def test_a_queue_declare_the_broker_refuses_is_one_line_exit_1(rabbit: Backend) -> None:
    """A queue that exists with other arguments (PRECONDITION_FAILED) is a reported failure."""
    queue = rabbit.q("PRIO")
    with kombu.Connection(RABBITMQ_URL) as conn:
        conn.channel().queue_declare(queue=queue, durable=True, auto_delete=False,
                                     arguments={"x-max-priority": 5})
    # Named in the settings (without a priority), so the send declares it first.
    settings = rabbit.write(ports={"Work": {"destination": rabbit.q("Q")}}, queues={queue: {}})
    result = mdb("send", queue, "{}", settings=settings, env=rabbit.env)
    line = one_line_error(result)
    assert result.returncode == 1
    assert queue in line and "PRECONDITION_FAILED" in line


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

    from mdbcontainer.cli.main import app

    def walk(command: object, path: list[str]) -> list[list[str]]:
        found = [path]
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            found += walk(sub, [*path, name])
        return found

    return walk(typer.main.get_command(app), [])


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = mdb("--version", env=CHILD_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"mdb (mdbcontainer) {version('mdbcontainer')}"


def test_dash_h_is_help_on_every_command() -> None:
    from typer.testing import CliRunner

    from mdbcontainer.cli.main import app

    runner = CliRunner()
    paths = every_command_path()
    assert ["dlq", "list"] in paths and ["port", "start"] in paths  # the walk reaches subcommands
    for path in paths:
        short = runner.invoke(app, [*path, "-h"], prog_name="mdb", terminal_width=100)
        long = runner.invoke(app, [*path, "--help"], prog_name="mdb", terminal_width=100)
        assert short.exit_code == 0, (path, short.output)
        assert "Usage: mdb" in short.output
        assert short.output == long.output, path


# -- bad input of every kind: one line, exit 1 or 2, never a traceback ------------------------

BAD_INPUT: list[tuple[str, list[str], dict[str, str], int, str]] = [
    # (case id, arguments ({good}, {tmp} filled in), environment, exit code, the culprit named)
    ("unknown-command", ["nosuch"], {}, 2, "No such command 'nosuch'"),
    ("unknown-option", ["send", "WORK", "{}", "--bogus", "-c", "{good}"], {}, 2, "--bogus"),
    ("missing-argument", ["send", "-c", "{good}"], {}, 2, "Missing argument 'DEST'"),
    ("body-not-json", ["send", "WORK", "{not json", "-c", "{good}"], {}, 2, "BODY is not JSON"),
    ("body-empty", ["send", "WORK", "", "-c", "{good}"], {}, 2, "BODY is not JSON"),
    ("body-file-missing", ["send", "WORK", "@{tmp}/nope.json", "-c", "{good}"], {}, 2, "nope.json"),
    ("body-file-is-a-folder", ["send", "WORK", "@{tmp}", "-c", "{good}"], {}, 2, "BODY"),
    ("body-file-not-utf8", ["send", "WORK", "@{tmp}/latin1.json", "-c", "{good}"], {}, 2,
     "latin1.json: not UTF-8"),
    ("body-file-empty", ["send", "WORK", "@{tmp}/empty.json", "-c", "{good}"], {}, 2, "empty.json"),
    ("body-file-not-json", ["send", "WORK", "@{tmp}/text.json", "-c", "{good}"], {}, 2,
     "text.json is not JSON"),
    ("ttl-not-a-duration", ["send", "WORK", "{}", "--ttl", "soon", "-c", "{good}"], {}, 2, "--ttl"),
    ("ttl-zero", ["send", "WORK", "{}", "--ttl", "0s", "-c", "{good}"], {}, 2, "--ttl"),
    ("ttl-negative", ["send", "WORK", "{}", "--ttl", "-5s", "-c", "{good}"], {}, 2, "--ttl"),
    ("priority-not-a-number", ["send", "WORK", "{}", "--priority", "high", "-c", "{good}"], {}, 2,
     "--priority"),
    ("priority-out-of-range", ["send", "WORK", "{}", "--priority", "12", "-c", "{good}"], {}, 2,
     "--priority"),
    ("count-zero", ["send", "WORK", "{}", "--count", "0", "-c", "{good}"], {}, 2, "--count"),
    ("header-without-value", ["send", "WORK", "{}", "-H", "novalue", "-c", "{good}"], {}, 2,
     "key=value"),
    ("timeout-not-a-duration", ["request", "WORK", "{}", "--timeout", "ever", "-c", "{good}"], {}, 2,
     "--timeout"),
    ("timeout-zero", ["request", "WORK", "{}", "--timeout", "0ms", "-c", "{good}"], {}, 2, "--timeout"),
    ("settings-missing", ["check", "-c", "{tmp}/nope.toml"], {}, 2, "nope.toml: settings file not found"),
    ("settings-is-a-folder", ["ports", "-c", "{tmp}"], {}, 2, "{tmp}"),
    ("settings-not-utf8", ["check", "-c", "{tmp}/latin1.json"], {}, 2, "latin1.json"),
    ("settings-not-toml", ["check", "-c", "{tmp}/text.json"], {}, 2, "text.json: invalid TOML"),
    ("settings-from-env-missing", ["ports"], {"MDB_SETTINGS": "{tmp}/gone.toml"}, 2, "gone.toml"),
    ("settings-key-of-the-loader", ["check", "-c", "{tmp}/source.toml"], {}, 2,
     "source.toml: source: unknown key 'source'"),
    ("unknown-queue-option", ["check", "-c", "{tmp}/queue-typo.toml"], {}, 2,
     "queues.WORK.backout_treshold"),
    ("bad-duration-in-settings", ["check", "-c", "{good}"], {"MDB_CONTAINER__CONTROL_INTERVAL": "often"},
     2, "environment variable MDB_CONTAINER__CONTROL_INTERVAL: container.control_interval"),
    ("bad-number-in-env", ["check", "-c", "{good}"], {"MDB_PORTS__WORK__MAX_RETRIES": "many"}, 2,
     "environment variable MDB_PORTS__WORK__MAX_RETRIES: ports.Work.max_retries"),
    ("unknown-port-to-run", ["run", "--port", "Wrok", "-c", "{good}"], {}, 2,
     "'Wrok': no such port (ports: Work). Did you mean 'Work'?"),
    ("unknown-port-to-start", ["port", "start", "Wrok", "-c", "{good}"], {}, 2,
     "no port 'Wrok' in {good} (ports: Work). Did you mean 'Work'?"),
    ("unknown-port-to-stop", ["port", "stop", "Wrok", "-c", "{good}"], {}, 2,
     "no port 'Wrok' in {good} (ports: Work). Did you mean 'Work'?"),
    ("older-than-not-a-duration", ["dedup", "purge", "--older-than", "old", "-c", "{good}"], {}, 2,
     "--older-than"),
    ("watch-and-json", ["ports", "--watch", "--json", "-c", "{good}"], {}, 2, "--watch"),
    ("dlq-unknown-queue", ["dlq", "list", "NO.SUCH.QUEUE", "-c", "{good}"], {}, 1, "NO.SUCH.QUEUE"),
    ("dlq-unknown-id", ["dlq", "show", "no-such-id", "-c", "{good}"], {}, 1, "no-such-id"),
    ("dlq-replay-nothing", ["dlq", "replay", "-c", "{good}"], {}, 2, "--all"),
    ("dlq-replay-ids-and-all", ["dlq", "replay", "x", "--all", "-c", "{good}"], {}, 2, "--all"),
    ("dlq-purge-unconfirmed", ["dlq", "purge", "-c", "{good}"], {}, 2, "--yes"),
    ("dlq-queue-named-twice", ["dlq", "list", "A", "--queue", "B", "-c", "{good}"], {}, 2,
     "QUEUE 'A' and --queue 'B'"),
    ("database-unreachable", ["ports", "-c", "{tmp}/no-db.toml"], {}, 1, "database"),
    ("database-folder-impossible", ["ports", "-c", "{tmp}/db-in-proc.toml"], {}, 1,
     "/proc/no-such-pid: No such file or directory"),
    ("port-from-env-not-a-table", ["check", "-c", "{good}"], {"MDB_PORTS__X": "1"}, 2,
     "environment variable MDB_PORTS__X: ports.x: must be a table"),
    ("unsubscribe-missing-argument", ["unsubscribe", "audit", "-c", "{good}"], {}, 2,
     "Missing argument 'SUBSCRIPTION'"),
    ("unsubscribe-unknown", ["unsubscribe", "nobody", "nothing", "-c", "{good}"], {}, 1,
     "no durable subscription 'nobody.nothing'"),
    ("broker-url-scheme", ["check", "-c", "{good}"], {"MDB_CONTAINER__BROKER_URL": "redis://x"}, 2,
     "environment variable MDB_CONTAINER__BROKER_URL: container.broker_url"),
]


@pytest.fixture
def bad_files(tmp_path: Path, good: Path) -> Path:
    (tmp_path / "latin1.json").write_bytes('{"name": "Müller"}'.encode("latin-1"))
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "text.json").write_text("hello world\n")
    (tmp_path / "source.toml").write_text('source = "elsewhere"\n')
    write_settings(tmp_path / "queue-typo.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d.db",
                      "broker_url": f"embedded://{tmp_path}/b.db"},
        "queues": {"WORK": {"backout_treshold": 3}},
        "ports": {"Work": {"destination": "WORK"}},
    })
    write_settings(tmp_path / "db-in-proc.toml", {"container": {
        "listeners": [], "database_url": "sqlite:////proc/no-such-pid/d.db",
    }})
    write_settings(tmp_path / "no-db.toml", {"container": {
        "listeners": [], "database_url": "postgresql+psycopg://postgres@127.0.0.1:1/test",
    }})
    return tmp_path


@pytest.mark.parametrize(("args", "env", "code", "culprit"), [c[1:] for c in BAD_INPUT],
                         ids=[c[0] for c in BAD_INPUT])
def test_every_bad_input_is_one_line_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], good: Path, bad_files: Path,
    args: list[str], env: dict[str, str], code: int, culprit: str,
) -> None:
    """In-process through the console entry point: fast, and any exception escaping fails here."""
    from mdbcontainer.cli.main import main

    def fill(text: str) -> str:
        return text.replace("{good}", str(good)).replace("{tmp}", str(bad_files))

    monkeypatch.chdir(bad_files)
    # ``mdb run`` sets up logging on the root logger: give it back to pytest afterwards.
    monkeypatch.setattr(logging.root, "handlers", logging.root.handlers[:])
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    monkeypatch.delenv("MDB_SETTINGS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, fill(value))
    monkeypatch.setattr(sys, "argv", ["mdb", *(fill(a) for a in args)])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert exited.value.code == code, captured.err
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert lines[0].startswith("mdb: error: ")
    assert fill(culprit) in lines[0]


def test_a_body_file_that_is_not_utf8_is_one_line(good: Path, tmp_path: Path) -> None:
    """The reported failure, as a user runs it: a subprocess, through ``python -m mdbcontainer``."""
    (tmp_path / "latin1.json").write_bytes('{"name": "Müller"}'.encode("latin-1"))
    result = mdb("send", "WORK", f"@{tmp_path / 'latin1.json'}", settings=good, env=CHILD_ENV)
    assert result.returncode == 2
    assert "latin1.json: not UTF-8" in one_line_error(result)


def test_an_unexpected_error_is_one_line_and_the_traceback_is_on_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], good: Path,
) -> None:
    from mdbcontainer.cli import main as cli
    from mdbcontainer.operations import ports as operate

    def broken(*args: object) -> None:
        raise RuntimeError("amqp://guest:secret@host went odd")

    monkeypatch.setattr(operate, "live_ports", broken)
    monkeypatch.setattr(sys, "argv", ["mdb", "ports", "-c", str(good)])
    monkeypatch.delenv("MDB_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "mdb: error: unexpected RuntimeError: amqp://guest:***@host went odd "
        "(a bug; MDB_TRACEBACK=1 shows where)\n")
    monkeypatch.setenv("MDB_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        cli.main()


def test_tables_fit_the_width_moving_cells_to_a_second_line_never_cutting_them() -> None:
    from mdbcontainer.support.terminal import Column, fit

    columns = [Column("id", keep=True), Column("note", 6), Column("zeros", right=True, drop=1),
               Column("when", 8, drop=2), Column("empty", drop=0)]
    rows = [["3f1c0a6e-1b2c-4d5e", "a long explanation of it", "0", "2026-11-30 20:40:53", "-"]]
    assert fit(columns, rows, 100) == [
        "id                  note                      zeros  when                 empty",
        "3f1c0a6e-1b2c-4d5e  a long explanation of it      0  2026-11-30 20:40:53  -",
    ]
    # 40 columns: the empty column goes; the zeros move under the row first (before the time,
    # though the time ranks higher), then the long note, whole; the time then fits back
    # beside the id, which stays whole on its line.
    assert fit(columns, rows, 40) == [
        "id                  when",
        "3f1c0a6e-1b2c-4d5e  2026-11-30 20:40:53",
        "    note: a long explanation of it",
        "    zeros: 0",
    ]


PORT_ROWS = [  # two processes of one fleet, ports without batches
    ["vm:18893:91c9d9", "OrdersPort", "ORDERS", "started", "0", "12", "10", "1", "1", "0", "1", "0", "0",
     "-", "-", "2026-12-01 13:45:36", ""],
    ["vm:18894:a1b2c3", "OrdersPort", "ORDERS", "stopped", "1", "3", "2", "0", "1", "0", "0", "0", "0",
     "-", "-", "2026-12-01 13:45:36", "message m-1 failed 1 time(s): RuntimeError: boom"],
]


@pytest.mark.parametrize("width", [80, 120])
def test_the_ports_table_keeps_the_container_drops_empty_columns_and_cuts_nothing(width: int) -> None:
    """The container tells two processes' rows apart: it stays; all-``-`` batches go first;
    what does not fit moves to a second line, whole (not ``sta…``)."""
    from mdbcontainer.cli.output import PORT_COLUMNS
    from mdbcontainer.support.terminal import fit

    lines = fit(PORT_COLUMNS, PORT_ROWS, width)
    assert all(len(line) <= width for line in lines), lines
    assert "…" not in "".join(lines)
    header = lines[0].split()
    assert header[:2] == ["container", "port"] and "state" in header
    assert "batches" not in lines[0] and "fallbacks" not in "".join(lines), "empty: left out"
    rows = [line for line in lines if line.startswith("vm:")]
    assert [r.split()[0] for r in rows] == ["vm:18893:91c9d9", "vm:18894:a1b2c3"]
    assert "started" in rows[0] and "stopped" in rows[1]
    text = " ".join(" ".join(lines).split())
    assert "reason: message m-1 failed 1 time(s): RuntimeError: boom" in text, "whole, under its row"
    for header_or_pair in ("handled", "duplicate"):  # the dedup step stays on the row's line
        assert header_or_pair in lines[0]
    if width == 120:
        assert "delivered" in lines[0] and "failures" in lines[0]


@pytest.mark.parametrize("width", [80, 120])
def test_the_dlq_list_keeps_reason_and_exception_whole(width: int) -> None:
    from mdbcontainer.cli.output import LIST_COLUMNS
    from mdbcontainer.support.terminal import fit

    exception = "ValidationError: 1 validation error for OrderPlaced order_id Input should be a valid integer"
    rows = [["3f1c0a6e-1b2c-4d5e-9f00-1234567890ab", "ORDERS", "OrdersPort", "invalid-body", "1",
             "2026-11-30 20:40:53", exception]]
    lines = fit(LIST_COLUMNS, rows, width)
    assert all(len(line) <= width for line in lines) and "…" not in "".join(lines), lines
    assert lines[1].startswith("3f1c0a6e-1b2c-4d5e-9f00-1234567890ab  ORDERS  ")
    assert "invalid-body" in lines[1], "the reason whole on the row's line"
    assert f"exception: {exception}" in " ".join(" ".join(lines).split())
    if width == 120:
        assert "failed at (UTC)" in lines[0] and "port" in lines[0]


@pytest.mark.parametrize("width", [80, 120])
def test_ports_watch_is_readable_at_the_terminal_width(width: int) -> None:
    """``mdb ports --watch`` follows the same rule: nothing cut to ``sta…`` at 120 columns."""
    from rich.console import Console

    from mdbcontainer.cli.watch import Sample, render

    fields = ("container", "port", "destination", "state", "consecutive_failures", "delivered",
              "handled", "duplicate_skipped", "failed", "backed_out", "invalid_body", "expired", "waiting")
    rows = [dict(zip(fields, row, strict=False)) | {"since": "2026-12-01T" + row[15][11:],
                                                    "reason": row[16]} for row in PORT_ROWS]
    sample = Sample(rows=rows, depths={"ORDERS": 7}, taken_at=1.0)
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render(sample, {}, "settings.toml", [], 1.0, width))
    lines = console.export_text().splitlines()
    table = [line for line in lines if line.startswith(("container", "vm:", "    "))]
    assert all(len(line) <= width for line in lines) and "…" not in "".join(lines), lines
    assert table[0].split()[:2] == ["container", "port"] and "state" in table[0]
    assert [line.split()[:4] for line in table if line.startswith("vm:")] == [
        ["vm:18893:91c9d9", "OrdersPort", "ORDERS", "started"],
        ["vm:18894:a1b2c3", "OrdersPort", "ORDERS", "stopped"]]
    assert "batches" not in "".join(table), "all - : left out"
    assert "reason: message m-1 failed 1 time(s): RuntimeError: boom" in " ".join(" ".join(table).split())


def test_a_missing_backout_message_is_the_exported_dlq_error(good: Path) -> None:
    from mdbcontainer import DlqError, load_settings
    from mdbcontainer.operations.dlq import find

    with pytest.raises(DlqError, match="message 'nope' not found"):
        find(load_settings(good, environ={}), "nope")


def test_check_warns_when_a_quorum_backout_threshold_meets_rabbitmq_4s_delivery_limit(
        tmp_path: Path) -> None:
    path = write_settings(tmp_path / "s.toml", {
        "container": {"listeners": ["tests.apps.work"], "database_url": f"sqlite:///{tmp_path}/d"},
        "queues": {"WORK": {"backout_threshold": 20, "quorum": True}, "DLQ": {"quorum": True}},
        "ports": {"Work": {"destination": "WORK", "max_retries": 20}},
    })
    result = mdb_here("check", settings=path)
    assert result.returncode == 0, result.stderr
    assert "backout_threshold = 20" in result.stderr and "delivery limit" in result.stderr, result.stderr
    path.write_text(path.read_text().replace("backout_threshold = 20", "backout_threshold = 19"))
    assert "delivery limit" not in mdb_here("check", settings=path).stderr
