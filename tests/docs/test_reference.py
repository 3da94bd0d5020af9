"""The reference pages' generator (docs/_hooks/reference.py) covers the code it is generated from.

Every settings key of the models appears with its default and a meaning, every
``mdb`` command and option a user can type appears, and a key nobody described
is a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer.main

import mdbcontainer
from mdbcontainer.cli.main import app
from mdbcontainer.settings import ContainerSettings, PortFields, QueueSettings
from mdbcontainer.settings.models import ConsoleSettings
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mdb_reference", ROOT / "docs" / "_hooks" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_settings_key_is_in_the_reference_with_its_default(reference: ModuleType,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        page = reference.settings_reference()
    assert caplog.records == [], "every key has its meaning"
    for prefix, model in (("container.", ContainerSettings), ("console.", ConsoleSettings),
                          ("queues.Q.", QueueSettings), ("ports.P.", PortFields)):
        for name in model.model_fields:
            table = page.split(f"### `[{prefix.split('.')[0]}", 1)[1].split("\n### ", 1)[0]
            row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
            assert row.count("|") >= 5 and not row.endswith("|  |"), (prefix, row)
    assert '| `shutdown_timeout` | duration | `"30s"` |' in page
    assert '| `max_retries` | integer, at least 0 | `0` |' in page
    assert '| `backout_threshold` | integer, at least 0 | `5` |' in page


def test_a_key_without_a_meaning_fails_the_strict_build(reference: ModuleType, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    meanings = (ROOT / "docs" / "_hooks" / "settings.yml").read_text()
    lacking = tmp_path / "settings.yml"
    lacking.write_text(meanings.replace("  max_retries:", "  max_retries_described_elsewhere:"))
    monkeypatch.setattr(reference, "MEANINGS", lacking)
    with caplog.at_level(logging.WARNING):
        reference.settings_reference()
    assert [r.getMessage() for r in caplog.records] == [
        "settings reference: ports.P.max_retries has no meaning in settings.yml"]
    assert all(r.levelno == logging.WARNING for r in caplog.records)  # --strict fails on a warning


def test_every_command_and_option_is_in_the_cli_reference(reference: ModuleType) -> None:
    page = reference.cli_reference()

    def walk(command: Any, path: str) -> None:
        subcommands = getattr(command, "commands", None)
        if subcommands is not None:
            for name, sub in subcommands.items():
                walk(sub, f"{path} {name}")
            return
        assert f"### `{path}`" in page
        section = page.split(f"### `{path}`", 1)[1].split("\n### ", 1)[0]
        for param in command.params:
            if param.param_type_name == "option" and not getattr(param, "hidden", False):
                assert f"`{param.opts[-1]}" in section, (path, param.opts)

    walk(typer.main.get_command(app), "mdb")
    assert "`--supervisor" not in page, "hidden options stay out"


def test_every_exported_error_is_in_the_errors_table(reference: ModuleType) -> None:
    page = reference.errors_reference()
    assert "| `SettingsError` | `MdbError` | 2 |" in page
    assert "| `Unroutable` | `PublishError` | 1 |" in page
    for name in mdbcontainer.__all__:
        value = getattr(mdbcontainer, name)
        if isinstance(value, type) and issubclass(value, mdbcontainer.MdbError):
            assert f"| `{name}` |" in page
