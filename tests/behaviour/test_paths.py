"""Relative paths in a settings file are relative to its folder (README: *Settings reference*).

Every ``mdb`` command, from any working directory, finds the same embedded
broker, SQLite database and TLS files as the container.
"""

from __future__ import annotations

from pathlib import Path

from mdbcontainer.settings import load_settings
from mdbcontainer.testing import QueueProbe, mdb, write_settings

LISTENER = """
from mdbcontainer import Message, message_driven

@message_driven("Paths", destination="PATHS")
def handler(message: Message) -> None: ...
"""


def app(tmp_path: Path, **container: str) -> Path:
    folder = tmp_path / "app"
    folder.mkdir()
    (folder / "paths_listener.py").write_text(LISTENER)
    return write_settings(folder / "settings.toml", {
        "container": {"broker_url": "embedded://.mdb/broker.db",
                      "database_url": "sqlite:///.mdb/container.db",
                      "listeners": ["paths_listener"], **container},
        "ports": {"Paths": {"destination": "PATHS"}},
    })


def test_send_from_another_folder_reaches_the_broker_beside_the_settings(tmp_path: Path) -> None:
    settings = app(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, config in ((elsewhere, "../app/settings.toml"), (settings.parent, "settings.toml")):
        result = mdb("send", "PATHS", '{"n": 1}', "-c", config, cwd=cwd)
        assert result.returncode == 0, result.stderr
    assert (settings.parent / ".mdb" / "broker.db").exists()
    assert not (elsewhere / ".mdb").exists(), "no second broker in the working directory"
    assert QueueProbe(load_settings(settings, environ={})).count("PATHS") == 2


def test_check_prints_the_resolved_broker_and_database(tmp_path: Path) -> None:
    settings = app(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = mdb("check", "-c", "../app/settings.toml", cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    folder = settings.parent.resolve()
    assert f"broker embedded://{folder}/.mdb/broker.db" in result.stdout
    assert f"database sqlite:///{folder}/.mdb/container.db" in result.stdout


def test_check_masks_the_passwords_it_prints(tmp_path: Path) -> None:
    # Nothing listens on port 1: check warns that both are down (and masks them there too).
    settings = app(tmp_path, broker_url="amqp://guest:brokerpw@127.0.0.1:1//",
                   database_url="postgresql+psycopg://app:dbpw@127.0.0.1:1/test")
    result = mdb("check", "-c", str(settings), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "broker amqp://guest:***@127.0.0.1:1//" in result.stdout
    assert "database postgresql+psycopg://app:***@127.0.0.1:1/test" in result.stdout
    assert "not reachable" in result.stderr
    assert "brokerpw" not in result.stdout + result.stderr and "dbpw" not in result.stdout + result.stderr


def test_tls_files_and_absolute_paths(tmp_path: Path) -> None:
    settings = app(tmp_path, ssl_ca="certs/ca.pem", ssl_cert="/etc/client.pem",
                   database_url=f"sqlite:///{tmp_path / 'abs.db'}")
    container = load_settings(settings, environ={}).container
    assert container.ssl_ca == str(settings.parent / "certs" / "ca.pem")
    assert container.ssl_cert == "/etc/client.pem", "an absolute path stays as it is"
    assert container.database_url == f"sqlite:///{tmp_path / 'abs.db'}"
