"""Settings: the TOML file, environment overrides, durations and one-line errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from mdbcontainer.errors import ListenerError, SettingsError
from mdbcontainer.settings import (
    PortSettings,
    format_duration,
    load_settings,
    mask_url,
    parse_duration,
    settings_from_dict,
)
from mdbcontainer.testing import mdb, write_settings
from tests.conftest import CHILD_ENV, mdb_here, one_line_error


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    return path


def test_defaults_follow_the_websphere_embedded_jms_server() -> None:
    settings = settings_from_dict({})
    assert settings.container.dead_letter_queue == "SYSTEM.DEAD.LETTER.QUEUE"
    assert settings.container.dedup_retention == timedelta(days=7)
    assert settings.queue("ANY").backout_threshold == 5
    port = PortSettings(destination="Q")
    assert (port.max_retries, port.concurrency, port.prefetch) == (0, 1, 10)
    assert port.transaction == "container" and port.is_once_only
    assert port.accept == ["application/json", "text/plain"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("500ms", 0.5), ("30s", 30), ("5m", 300), ("7d", 604800), ("2h", 7200), (15, 15)],
)
def test_durations(text: str | int, expected: float) -> None:
    assert parse_duration(text).total_seconds() == expected


def test_duration_round_trip_and_bad_duration() -> None:
    assert format_duration(timedelta(seconds=30)) == "30s"
    assert format_duration(timedelta(milliseconds=1500)) == "1500ms"
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_unknown_key_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, '[ports.OrdersPort]\ndestination = "ORDERS"\nmax_retry = 3\n')
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={})
    message = str(err.value)
    assert message == (
        f"{path}: ports.OrdersPort.max_retry: unknown key 'max_retry'. Did you mean 'max_retries'?"
    )
    assert "\n" not in message


def test_unknown_container_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, '[container]\nbroker_ulr = "embedded://b.db"\n')
    with pytest.raises(SettingsError, match=r"container.broker_ulr: unknown key .*Did you mean 'broker_url'"):
        load_settings(path, environ={})


def test_wrong_type_names_file_and_key_path(tmp_path: Path) -> None:
    path = write(tmp_path, '[ports.OrdersPort]\ndestination = "ORDERS"\nmax_retries = -1\n')
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={})
    assert str(err.value) == (
        f"{path}: ports.OrdersPort.max_retries: Input should be greater than or equal to 0"
    )


def test_malformed_toml_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[container\nbroker_url = 1\n")
    with pytest.raises(SettingsError, match=r"invalid TOML") as err:
        load_settings(path, environ={})
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="settings file not found"):
        load_settings(tmp_path / "nope.toml", environ={})


def test_environment_overrides_any_key_case_insensitively(tmp_path: Path) -> None:
    path = write(tmp_path, '[container]\nbroker_url = "embedded://b.db"\n[ports.OrdersPort]\ndestination = "O"\n')
    settings = load_settings(path, environ={
        "MDB_CONTAINER__BROKER_URL": "amqp://guest:guest@127.0.0.1//",
        "MDB_PORTS__ORDERSPORT__MAX_RETRIES": "7",
        "MDB_QUEUES__O__BACKOUT_THRESHOLD": "2",
        "MDB_CONTAINER__LISTENERS": '["a.b", "c"]',
        "MDB_SETTINGS": "ignored.toml",
    })
    assert settings.container.broker_url == "amqp://guest:guest@127.0.0.1//"
    assert settings.port_overrides("OrdersPort") == {"destination": "O", "max_retries": 7}
    assert settings.queue("O").backout_threshold == 2
    assert settings.container.listeners == ["a.b", "c"]


def test_settings_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[container]\ndead_letter_queue = "MY.DLQ"\n')
    monkeypatch.setenv("MDB_SETTINGS", str(path))
    assert load_settings().container.dead_letter_queue == "MY.DLQ"


@pytest.mark.parametrize(
    ("port", "message"),
    [
        ({"destination": "Q", "transaction": "container", "acknowledge": "client"},
         "cannot apply with transaction = 'container'"),
        ({"destination": "Q", "once_only": True, "transaction_attribute": "NotSupported"},
         "once_only = true needs a database transaction"),
        ({"destination": "Q", "topic": "t"}, "exactly one of 'destination'"),
        ({"topic": "t", "durable": True}, "durable = true needs both"),
        ({"destination": "Q", "accept": ["application/x-python-serialize"]}, "pickle is never accepted"),
    ],
)
def test_contradictory_combinations_are_settings_errors(port: dict, message: str) -> None:
    from mdbcontainer.settings import validate_port

    with pytest.raises(SettingsError, match=message):
        validate_port("settings.toml", "P", port)


def test_passwords_are_masked() -> None:
    assert mask_url("amqp://guest:s3cret@host:5672//") == "amqp://guest:***@host:5672//"
    assert mask_url("postgresql+psycopg://app:pw@db/x") == "postgresql+psycopg://app:***@db/x"
    assert mask_url("amqp://host//") == "amqp://host//"


def test_bind_errors_are_one_line(tmp_path: Path) -> None:
    from mdbcontainer.handlers.binding import bind

    missing = settings_from_dict({"container": {"listeners": ["no.such.module"]}})
    with pytest.raises(ListenerError, match="listener module 'no.such.module' not found"):
        bind(missing)
    orphan = settings_from_dict({
        "container": {"listeners": ["tests.apps.work"]},
        "ports": {"Work": {"destination": "Q"}, "Ghost": {"destination": "G"}},
    })
    with pytest.raises(ListenerError, match=r"ports.Ghost: no handler"):
        bind(orphan)
    nodest = settings_from_dict({"container": {"listeners": ["tests.apps.work"]}})
    with pytest.raises(ListenerError, match="port 'Work' has no destination"):
        bind(nodest)


def test_inline_defaults_are_overridden_key_by_key() -> None:
    from mdbcontainer.handlers.binding import bind

    settings = settings_from_dict({
        "container": {"listeners": ["tests.apps.bean"]},
        "ports": {"Bean": {"destination": "Q", "max_retries": 3}},
    })
    [binding] = bind(settings)
    assert binding.settings.transaction == "bean"  # from @message_driven(..., transaction="bean")
    assert binding.settings.max_retries == 3  # from TOML


def test_an_error_from_an_environment_variable_names_the_variable(tmp_path: Path) -> None:
    path = write(tmp_path, '[ports.PayPort]\ndestination = "PAY"\n')
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={"MDB_PORTS__PAYPORT__MAX_RETRIE": "3"})
    assert str(err.value) == (
        "environment variable MDB_PORTS__PAYPORT__MAX_RETRIE: ports.PayPort.max_retrie: "
        "unknown key 'max_retrie'. Did you mean 'max_retries'?"
    )
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={"MDB_CONTAINER__CONTROL_INTERVAL": "often"})
    assert str(err.value).startswith(
        "environment variable MDB_CONTAINER__CONTROL_INTERVAL: container.control_interval: 'often'"
    )
    # A fault in the file is still the file's, whatever else the environment overrides.
    path.write_text('[ports.PayPort]\ndestination = "PAY"\nprefetch = "x"\n')
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={"MDB_PORTS__PAYPORT__MAX_RETRIES": "3"})
    assert str(err.value).startswith(f"{path}: ports.PayPort.prefetch: ")


def test_a_combination_the_environment_made_names_file_and_variable(tmp_path: Path) -> None:
    from mdbcontainer.handlers.binding import bind

    path = write(tmp_path, '[container]\nlisteners = ["tests.apps.work"]\n'
                           '[ports.Work]\ndestination = "W"\nonce_only = true\n')
    settings = load_settings(path, environ={"MDB_PORTS__WORK__TRANSACTION": "none"})
    with pytest.raises(SettingsError) as err:
        bind(settings)
    assert str(err.value).startswith(f"{path} with MDB_PORTS__WORK__TRANSACTION: ports.Work: once_only")


def test_a_missing_listener_module_names_the_settings_file(tmp_path: Path) -> None:
    from mdbcontainer.handlers.binding import bind

    path = write(tmp_path, '[container]\nlisteners = ["listeners.nope"]\n')
    with pytest.raises(ListenerError) as err:
        bind(load_settings(path, environ={}))
    assert str(err.value) == (
        f"{path}: container.listeners: listener module 'listeners.nope' not found (is it on the path?)"
    )


def test_a_misspelled_port_in_a_decorator_gets_a_did_you_mean(tmp_path: Path) -> None:
    from mdbcontainer.handlers.binding import bind

    module = f"pay_{tmp_path.name.replace('-', '_')}"  # unique: never a cached module of another test
    (tmp_path / f"{module}.py").write_text(
        "from mdbcontainer import message_driven\n\n"
        '@message_driven("PayPrt")\ndef charge(body: dict, ctx: object) -> None:\n    pass\n'
    )
    path = write(tmp_path, f'[container]\nlisteners = ["{module}"]\n[ports.PayPort]\ndestination = "PAY"\n')
    with pytest.raises(ListenerError) as err:
        bind(load_settings(path, environ={}))
    assert str(err.value).endswith(
        f". Did you mean @message_driven('PayPort') in {module}:charge, which says 'PayPrt'?"
    )
    path.write_text(f'[container]\nlisteners = ["{module}"]\n[ports.Refunds]\ndestination = "R"\n')
    with pytest.raises(ListenerError) as err:
        bind(load_settings(path, environ={}))
    assert "Did you mean" not in str(err.value)  # nothing close: no guess


@pytest.mark.parametrize("url", ["memory://", "redis://127.0.0.1:6379/0"])
def test_a_broker_url_no_behaviour_test_runs_on_is_refused(tmp_path: Path, url: str) -> None:
    """memory:// was accepted once, but it does not flag redeliveries and nothing tested it."""
    path = write(tmp_path, f'[container]\nbroker_url = "{url}"\n')
    with pytest.raises(SettingsError, match=r"container.broker_url: .*is not a broker this package runs on"):
        load_settings(path, environ={})


# -- as ``mdb`` reports them ----------------------------------------------------------------


@pytest.mark.parametrize("queues", [{}, {"DLQ": {"backout_queue": "DLQ"}}])
def test_a_port_whose_queue_is_its_own_backout_queue_is_a_settings_error(
    tmp_path: Path, queues: dict[str, object],
) -> None:
    """A port that reads the backout queue (a DLQ processor) would back a failing message out
    onto the queue it reads, where it fails again, for ever: such
    contradictory combinations are settings errors (exit 2, one line)."""
    settings = write_settings(tmp_path / "settings.toml", {
        "container": {
            "broker_url": f"embedded://{tmp_path / 'broker.db'}",
            "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
            "listeners": ["tests.apps.work"], "dead_letter_queue": "DLQ",
        },
        "queues": queues,
        "ports": {"Work": {"destination": "DLQ"}},
    })
    for verb in ("check", "run"):  # check in this process (no Python start-up), run as a process
        result = (mdb_here(verb, settings=settings) if verb == "check"
                  else mdb(verb, settings=settings, env=CHILD_ENV))
        line = one_line_error(result)
        assert result.returncode == 2, result.stderr
        assert "ports.Work" in line and "backout" in line
    ok = settings.read_text() + '\n[queues.DLQ]\nbackout_threshold = 0\n' if not queues else None
    if ok:
        settings.write_text(ok)
        assert mdb_here("check", settings=settings).returncode == 0, "threshold 0: nothing backed out"


@pytest.mark.parametrize(("key", "value", "says"), [
    # A zero interval made the control loop poll the database without pause (a busy loop).
    ("control_interval", "0s", ""),
    # A grace under a second would relay rows their consumers are publishing now: sends twice.
    ("outbox_relay_grace", "200ms", "at least '1s'"),
])
def test_a_container_interval_too_short_is_a_settings_error(tmp_path: Path, key: str, value: str,
                                                             says: str) -> None:
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": f"embedded://{tmp_path / 'broker.db'}",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "listeners": ["tests.apps.work"], key: value,
    }, "ports": {"Work": {"destination": "WORK"}}})
    result = mdb_here("check", settings=settings)
    line = one_line_error(result)
    assert result.returncode == 2
    assert f"container.{key}" in line and says in line


def test_a_broker_url_of_no_supported_kind_is_a_settings_error(tmp_path: Path) -> None:
    """mdb check said ok and mdb send ended in a KeyError traceback ('No such transport')."""
    settings = write_settings(tmp_path / "settings.toml", {"container": {
        "broker_url": "rabbit://guest:s3cret-pw@127.0.0.1//",
        "database_url": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "listeners": ["tests.apps.work"],
    }, "ports": {"Work": {"destination": "WORK"}}})
    for args in (("check",), ("send", "Q", "{}")):  # check in this process, send as a process
        result = (mdb_here(*args, settings=settings) if args == ("check",)
                  else mdb(*args, settings=settings, env=CHILD_ENV))
        line = one_line_error(result)
        assert result.returncode == 2
        assert "container.broker_url" in line and "amqp://" in line
        assert "s3cret-pw" not in result.stderr
