"""The public API is typed as a user's type checker sees it.

A snippet that uses the API is checked with ``mypy --strict``: ``assert_type``
fails when an annotation decays to ``Any`` or becomes optional, and a keyword
that does not exist must be an error, not swallowed by ``**options``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

SNIPPET = '''
from datetime import timedelta
from typing import Any, assert_type

from mdbcontainer import Message, MessageContext, Producer, Settings, load_settings
from mdbcontainer.settings import PortFields, parse_duration

settings: Settings = load_settings("settings.toml")
assert_type(settings.ports, dict[str, PortFields])
assert_type(settings.ports["P"].max_retries, int)
assert_type(settings.port_overrides("P"), dict[str, Any])
assert_type(parse_duration("30s"), timedelta)


def handler(message: Message, ctx: MessageContext) -> None:
    assert_type(message.id, str)
    assert_type(ctx.send("Q", b"x", content_type="image/png", priority=4), str)
    assert_type(ctx.reply({"ok": True}, headers={"h": "v"}, correlation_id="c"), str)


with Producer.from_settings(settings) as producer:
    assert_type(producer.send("Q", "text", ttl="30s", message_id="m", content_type="text/csv"), str)
    assert_type(producer.request("Q", {}, timeout=5, headers={}), Message)
    producer.send("Q", {}, colour="red")  # the one error expected below
'''


@pytest.mark.slow
def test_the_public_api_type_checks_as_documented(tmp_path: Path) -> None:
    snippet = tmp_path / "uses_the_api.py"
    snippet.write_text(textwrap.dedent(SNIPPET))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         str(snippet)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, result.stdout
    assert 'Unexpected keyword argument "colour"' in errors[0], result.stdout
