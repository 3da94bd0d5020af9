"""The console's Host and Origin checks (DNS rebinding) and its token comparison, in process."""

from __future__ import annotations

import pytest

from mdbcontainer.console.security import TokenGate, allowed_hosts, host_name, same_origin


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:8089", "localhost"), ("LOCALHOST.:8089", "localhost"), ("127.0.0.1", "127.0.0.1"),
    ("[::1]:8089", "::1"), ("[::1]", "::1"), ("rebind.attacker.example:8089", "rebind.attacker.example"),
])
def test_the_name_of_a_host_header(header: str, name: str) -> None:
    assert host_name(header) == name


def test_without_a_token_only_the_bound_address_and_loopback_names_are_answered() -> None:
    hosts = allowed_hosts("127.0.0.2", None)
    assert hosts is not None
    assert {"localhost", "127.0.0.1", "::1", "127.0.0.2"} == set(hosts)
    assert allowed_hosts("0.0.0.0", "token") is None, "with a token, the token guards every name"


@pytest.mark.parametrize(("origin", "host", "same"), [
    ("http://localhost:8089", "localhost:8089", True),
    ("http://127.0.0.1:8089", "127.0.0.1:8089", True),
    ("http://localhost", "localhost:80", True),
    ("http://rebind.attacker.example:8089", "localhost:8089", False),
    ("http://localhost:9999", "localhost:8089", False),
    ("null", "localhost:8089", False),  # not a site: from_another_site lets it pass (no-referrer)
])
def test_an_origin_is_the_console_only_with_its_name_and_port(origin: str, host: str, same: bool) -> None:
    assert same_origin(origin, host, "http") is same


def test_a_token_or_cookie_with_any_character_is_compared_not_raised() -> None:
    assert not TokenGate.same("café", "token")
    assert TokenGate.same("café", "café")
