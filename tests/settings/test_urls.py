"""Masking URL passwords whatever they hold, and hiding the settings' passwords in any text."""

from __future__ import annotations

import pytest

from mdbcontainer.settings import mask_url
from mdbcontainer.settings.urls import broker_url_problem, database_url_problem, remember_password


@pytest.mark.parametrize(("text", "masked"), [
    ("amqp://guest:guest@host:5672//", "amqp://guest:***@host:5672//"),
    ("postgresql+psycopg://app:s3/cret@db/x", "postgresql+psycopg://app:***@db/x"),
    ("postgresql+psycopg://app:p@ss@db/x", "postgresql+psycopg://app:***@db/x"),
    ("amqp://a:p1@h1//;amqp://b:p2@h2//", "amqp://a:***@h1//;amqp://b:***@h2//"),
    ("cannot reach 'amqp://a:x/y@h//' now, email ops@example.org",
     "cannot reach 'amqp://a:***@h//' now, email ops@example.org"),
    ("amqp://host//", "amqp://host//"),
    ("embedded:///tmp/broker.db", "embedded:///tmp/broker.db"),
])
def test_a_url_password_is_masked_whatever_it_holds(text: str, masked: str) -> None:
    assert mask_url(text) == masked


def test_a_settings_password_is_hidden_in_a_text_without_its_url() -> None:
    remember_password("postgresql+psycopg://app:Tr1cky%2Fpass@db/x")
    text = "driver said: authentication of Tr1cky/pass failed (Tr1cky%2Fpass)"
    assert mask_url(text) == "driver said: authentication of *** failed (***)"
    remember_password("amqp://guest:guest@h//")
    assert mask_url("amqp://guest:guest@h//") == "amqp://guest:***@h//", "a user name stays shown"


def test_urls_their_clients_would_misread_are_named() -> None:
    assert broker_url_problem("amqp://app:s3/cret@mq:5672//") is not None
    assert broker_url_problem("amqp://app:s3%2Fcret@mq:5672//") is None
    assert broker_url_problem("amqp://app:p@ss@mq:5672//") is None, "urllib splits at the last @"
    assert broker_url_problem("embedded:///tmp/a@b.db") is None
    assert database_url_problem("postgresql+psycopg://app:p@ss@db/x") is not None
    assert database_url_problem("postgresql+psycopg://app:s3/cret@db/x") is None
    assert database_url_problem("sqlite:////tmp/a@b/x.db") is None
