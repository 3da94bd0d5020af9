"""docs/guides/testing.md: the tests it shows for the README's order handler run, and pass.

The guide's first Python block is a test module of a user's (the order
handler of listeners/orders.py, settings.example.toml); it is run here as
written, so the page cannot drift from what the kit does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

GUIDE = ROOT / "docs" / "guides" / "testing.md"


def guide_tests() -> dict[str, Any]:
    [first, *_] = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    namespace: dict[str, Any] = {"__name__": "guide"}
    exec(compile(first, str(GUIDE), "exec"), namespace)
    return {name: f for name, f in namespace.items() if name.startswith("test_")}


@pytest.mark.parametrize("name", sorted(guide_tests()))
def test_the_guides_order_handler_test(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the guide names settings.example.toml as a user's project does
    guide_tests()[name]()


def test_the_guide_names_every_crash_point_of_a_delivery() -> None:
    from mdbcontainer.support.crash import POINTS

    text = GUIDE.read_text()
    # mid-replay and outbox-relay are points of mdb dlq replay and of the relay, not of a delivery
    missing = [p for p in POINTS if p not in ("mid-replay", "outbox-relay") and f"`{p}`" not in text]
    assert not missing, f"docs/guides/testing.md does not name {missing}"
    assert Path(GUIDE).exists()
