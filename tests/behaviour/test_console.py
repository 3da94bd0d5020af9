"""``mdb console``, used as an operator uses it: in a real headless browser, against a running fleet.

A container (``mdb run``) and the console (``mdb console``) run as processes on
the same settings; Debian's Chromium, driven by Playwright, clicks the buttons
by their accessible names. The refusals (token, CSRF, GET) are plain HTTP
requests, as an attacker's would be. With ``MDB_CONSOLE_SCREENSHOTS=DIR`` the
screenshots of each page are kept in DIR (docs/console/ holds the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from mdbcontainer.settings import QueueSettings
from mdbcontainer.state.control import Control
from mdbcontainer.state.history import History
from mdbcontainer.state.store import Store
from mdbcontainer.testing import mdb, wait_for
from mdbcontainer.wire.delays import wait_queues
from tests.behaviour.helpers import console, request
from tests.conftest import ROOT, Backend, on_embedded, one_line_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHROMIUM = "/usr/bin/chromium"
# Chromium on a machine with no way out: no background calls home (README, "The console").
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cookies_of(headers: dict[str, str]) -> dict[str, str]:
    found = {}
    for part in headers.get("set-cookie", "").split(","):
        name, _, value = part.strip().partition("=")
        if name:
            found[name] = value.split(";")[0]
    return found


def csrf_of(page_html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', page_html)
    assert match, "every form of the page carries the CSRF token"
    return match.group(1)


# -- the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright (pip install 'mdbcontainer[test]')")
    if not Path(CHROMIUM).exists():
        _missing("chromium (apt-get install chromium; .ci/run installs it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _missing(what: str) -> None:
    if os.environ.get("MDB_REQUIRE_SERVICES"):
        pytest.fail(f"{what} is missing (MDB_REQUIRE_SERVICES=1: a missing tool is a failure)")
    pytest.skip(f"{what} is missing")


@pytest.fixture
def page(browser: Any, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1500, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(10_000)
    yield tab
    context.close()


def screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot into the test's folder, and into $MDB_CONSOLE_SCREENSHOTS when set."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("MDB_CONSOLE_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def only_local_requests(page: Any, base: str) -> list[str]:
    """Collects every URL the page asks for that the console does not serve."""
    elsewhere: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(base) else elsewhere.append(r.url))
    return elsewhere


def work_settings(backend: Backend, queue: str) -> Path:
    """Port Work on ``queue``: JSON only, backed out after 2 deliveries, never stopped by them."""
    return backend.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1,
                        "accept": ["application/json"]}},
        queues={queue: {"backout_threshold": 2}},
    )


def history(backend: Backend, settings: Path) -> list[Any]:
    store = Store(backend.settings(settings).container)
    try:
        return History(store).newest()
    finally:
        store.dispose()


# -- Ports ----------------------------------------------------------------------------------


def test_ports_page_shows_the_fleet_and_stops_and_starts_a_port(rabbit: Backend, page: Any,
                                                                  tmp_path: Path) -> None:
    from playwright.sync_api import expect

    queue, poisoned, delayed = rabbit.q("IN"), rabbit.q("POISON"), rabbit.q("DELAYED")
    rabbit.queues.update(wait_queues(delayed, QueueSettings(redelivery_delay="1m")))
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1},
               "Poison": {"destination": poisoned},  # max_retries 1: a poison message stops it
               "Delayed": {"destination": delayed, "max_retries": 10}},
        queues={queue: {"backout_threshold": 2}, poisoned: {}, delayed: {"redelivery_delay": "1m"}},
        outbox_relay_grace="1s",  # the waiting count is measured as often as the relay looks
    )
    with rabbit.container(settings) as container, console(rabbit, settings) as base:
        elsewhere = only_local_requests(page, base)
        with rabbit.producer(settings) as producer:
            producer.send(queue, {"n": 1, "action": "fail"}, message_id="poison-1")
            for n in range(5):
                producer.send(queue, {"n": n, "action": "ok"}, message_id=f"ok-{n}")
            producer.send(poisoned, {"n": 9, "action": "fail"}, message_id="poison-9")
            producer.send(delayed, {"n": 1, "fail": 1}, message_id="waits")
        wait_for(lambda: (container.port_state("Work") or {}).get("backed_out") == 1, what="a backout")
        wait_for(lambda: container.port_state("Work")["handled"] == 5, what="five handled")
        wait_for(lambda: container.port_state("Poison")["state"] == "stopped", what="Poison stopped")
        page.goto(base + "/")
        row = page.locator('tr[data-port="Work"]')
        expect(row.locator(".state")).to_have_text("started")
        expect(row.locator("td.failure")).to_have_text("RuntimeError: poison message 1")
        expect(row).to_contain_text(container.rows()[0]["container"])
        stopped = page.locator('tr[data-port="Poison"]')
        expect(stopped.locator(".state")).to_have_text("stopped")
        expect(stopped.locator(".reason")).to_contain_text("maximum retries (1) exceeded")
        expect(stopped.locator("td.failure")).to_have_text("RuntimeError: poison message 9")
        expect(page.get_by_role("button", name="Start Poison", exact=True)).to_be_visible()
        # A failed message waiting out its redelivery delay on the broker, as mdb ports counts it.
        expect(page.locator('tr[data-port="Delayed"] td.waiting')).to_have_text("1", timeout=10_000)
        # The chart's rates come from samples the console takes: the handled ones show up.
        expect(row.locator("svg[role=img]")).to_have_attribute(
            "aria-label", re.compile(r"^[1-9]\d* handled and [1-9]\d* failed in the last 5 min$"),
            timeout=15_000)
        screenshot(page, tmp_path, "ports")

        page.get_by_role("button", name="Stop Work", exact=True).click()
        started = time.monotonic()
        expect(row.locator(".state")).to_have_text("stopped", timeout=2_000)
        assert time.monotonic() - started < 2.0
        expect(page.get_by_role("status")).to_contain_text("port Work: stopped requested")
        assert container.port_state("Work")["state"] == "stopped", "the container stopped consuming"
        screenshot(page, tmp_path, "ports-stopped")

        # A start made with the CLI shows on the open page, with no reload, within 2 s.
        page.evaluate("window.notReloaded = true")
        assert mdb("port", "start", "Work", settings=settings, env=rabbit.env).returncode == 0
        started = time.monotonic()
        expect(row.locator(".state")).to_have_text("started", timeout=2_000)
        assert time.monotonic() - started < 2.0
        assert page.evaluate("window.notReloaded") is True, "the page redrew itself"
        expect(page.get_by_role("button", name="Stop Work", exact=True)).to_be_visible()

        page.get_by_role("button", name="Stop Work", exact=True).click()
        expect(page.get_by_role("button", name="Start Work", exact=True)).to_be_visible(timeout=2_000)
        page.get_by_role("button", name="Start Work", exact=True).click()
        expect(row.locator(".state")).to_have_text("started", timeout=2_000)
        assert elsewhere == [], f"the page asked for something the console does not serve: {elsewhere}"

    actions = [(a.action, a.target, a.origin.split(" ")[0]) for a in history(rabbit, settings)]
    assert actions == [("start", "Work", "console"), ("stop", "Work", "console"),
                       ("start", "Work", "cli"), ("stop", "Work", "console")], "newest first"


# -- Backout queues and History ------------------------------------------------------------------


def test_backout_queue_page_shows_replays_and_purges_like_mdb_dlq(rabbit: Backend, page: Any,
                                                                  tmp_path: Path) -> None:
    from playwright.sync_api import expect

    queue, poisoned = rabbit.q("IN"), rabbit.q("POISON")
    boq, dlq = rabbit.q("BOQ"), rabbit.q("DLQ")
    settings = rabbit.write(
        ports={"Work": {"destination": queue, "max_retries": 10, "prefetch": 1},
               "Poison": {"destination": poisoned, "max_retries": 10}},
        queues={queue: {"backout_threshold": 2, "backout_queue": boq},
                poisoned: {"backout_threshold": 1}},  # its backout queue: the dead-letter queue
    )
    big = "x" * 3000
    with rabbit.container(settings) as container, console(rabbit, settings) as base:
        with rabbit.producer(settings) as producer:
            for n in range(1, 5):
                producer.send(queue, {"n": n, "action": "fail", "pad": big if n == 1 else ""},
                              message_id=f"bad-{n}")
            for n in (1, 2):
                producer.send(poisoned, {"n": n, "action": "fail"}, message_id=f"p-{n}")
        wait_for(lambda: rabbit.probe(settings).count(boq) == 4, what="four backouts")
        wait_for(lambda: rabbit.probe(settings).count(dlq) == 2, what="two dead letters")
        # Replayed messages wait on their queues, so the page is seen without a new backout.
        for port in ("Work", "Poison"):
            assert mdb("port", "stop", port, settings=settings, env=rabbit.env).returncode == 0
            wait_for(lambda p=port: container.port_state(p)["state"] == "stopped", what=f"{port} stopped")

        page.goto(base + "/queues")  # every backout queue of the settings, one section each
        sections = page.locator("section.queue")
        expect(sections).to_have_count(2)
        expect(page.get_by_role("heading", name=dlq, exact=True)).to_be_visible()
        expect(page.get_by_role("heading", name=boq, exact=True)).to_be_visible()
        expect(page.locator('tr[data-id="p-2"]')).to_contain_text(poisoned)
        screenshot(page, tmp_path, "backout-queues")
        page.get_by_role("button", name=f"Replay all on {dlq}", exact=True).click()
        expect(page.get_by_role("status")).to_contain_text("replayed 2 message(s) (all)")
        expect(page.locator(f'section[data-queue="{dlq}"]')).to_contain_text(f"No messages on {dlq}")
        assert rabbit.probe(settings).count(poisoned) == 2

        page.get_by_role("link", name=boq, exact=True).click()  # one queue alone
        expect(sections).to_have_count(1)
        rows = page.locator("table.messages tbody tr")
        expect(rows).to_have_count(4)
        first = page.locator('tr[data-id="bad-1"]')
        for text in (queue, "Work", "backout-threshold", "RuntimeError: poison message 1"):
            expect(first).to_contain_text(text)
        expect(page.get_by_role("button", name="Replay all", exact=True)).to_be_visible()
        screenshot(page, tmp_path, "backout-queue")

        page.get_by_role("link", name="Show message bad-1", exact=True).click()
        expect(page.get_by_role("heading", name="Message bad-1", exact=True)).to_be_visible()
        expect(page.locator("pre.exception")).to_contain_text("Traceback (most recent call last)")
        expect(page.locator("table.pairs").first).to_contain_text("x-mdb-original-destination")
        assert len(page.locator("pre.body").inner_text()) < 2100, "the body is cut at 2,000 characters"
        screenshot(page, tmp_path, "message")
        page.get_by_role("link", name="Show the whole body").click()
        expect(page.locator("pre.body")).to_contain_text(big)

        page.get_by_role("button", name="Replay bad-1", exact=True).click()
        expect(page.get_by_role("status")).to_contain_text("replayed 1 message(s) (bad-1)")
        expect(rows).to_have_count(3)

        page.get_by_role("checkbox", name="Select bad-3", exact=True).check()
        page.get_by_role("button", name="Replay selected", exact=True).click()
        expect(page.get_by_role("status")).to_contain_text("replayed 1 message(s) (bad-3)")
        expect(rows).to_have_count(2)
        assert rabbit.probe(settings).count(queue) == 2, "the replayed messages wait on their queue"
        assert rabbit.probe(settings).count(boq) == 2

        page.once("dialog", lambda dialog: dialog.dismiss())
        page.get_by_role("button", name=f"Purge {boq}", exact=True).click()
        expect(rows).to_have_count(2)
        assert rabbit.probe(settings).count(boq) == 2, "a purge not confirmed deletes nothing"
        asked: list[str] = []

        def accept(dialog: Any) -> None:
            asked.append(dialog.message)
            dialog.accept()

        page.once("dialog", accept)
        page.get_by_role("button", name=f"Purge {boq}", exact=True).click()
        expect(page.get_by_role("status")).to_contain_text(f"purged 2 message(s) from {boq}")
        expect(rows).to_have_count(0)
        assert asked and boq in asked[0], "the browser asked first"
        assert rabbit.probe(settings).count(boq) == 0

        page.get_by_role("link", name="History", exact=True).click()
        expect(page.get_by_role("heading", name="History", exact=True)).to_be_visible()
        actions = page.locator("table.history tbody tr")
        expect(actions).to_have_count(6)
        assert [a.get_attribute("data-action") for a in actions.all()] == [
            "purge", "replay", "replay", "replay", "stop", "stop"], "newest first"
        expect(actions.nth(4)).to_contain_text("Poison")
        expect(actions.nth(5)).to_contain_text("cli on")
        expect(actions.nth(0)).to_contain_text("console from 127.0.0.1")
        expect(actions.nth(1)).to_contain_text("replayed 1 message(s) (bad-3)")
        screenshot(page, tmp_path, "history")


# -- Security ---------------------------------------------------------------------------------------


# The token check is the console's HTTP layer, whatever the transport behind it.
@on_embedded
def test_another_bind_needs_a_token_and_every_request_without_it_is_401(backend: Backend, page: Any,
                                                                        tmp_path: Path) -> None:
    from playwright.sync_api import expect

    settings = work_settings(backend, backend.q("IN"))
    port = free_port()
    refused = mdb("console", "--bind", f"0.0.0.0:{port}", settings=settings, env=backend.env)
    line = one_line_error(refused, 2)
    assert "[console] token" in line and "0.0.0.0" in line
    line = one_line_error(mdb("console", "--bind", "localhost", settings=settings, env=backend.env), 2)
    assert "--bind 'localhost'" in line and "HOST:PORT" in line

    token = "s3cret-token-value"
    with console(backend, settings, bind=f"0.0.0.0:{port}", env={"MDB_CONSOLE__TOKEN": token}) as base:
        for method, path in (("GET", "/"), ("GET", "/queues"), ("GET", "/history"),
                             ("GET", "/ports/rows"), ("POST", "/ports/Work/stop"),
                             ("POST", "/queues/purge")):
            status, headers, body = request(base, method, path)
            assert status == 401, (method, path, status)
            assert "location" not in headers, "a refusal is never a redirect"
        status, _, body = request(base, "GET", "/")
        assert 'type="password"' in body and "Token" in body, "the 401 page asks for the token"
        assert request(base, "GET", "/static/console.css")[0] == 200
        assert request(base, "GET", "/login")[0] == 200
        assert request(base, "GET", "/", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(base, "GET", "/", headers={"Authorization": f"Bearer {token}"})[0] == 200

        page.goto(base + "/history")
        expect(page.get_by_role("heading", name="Log in")).to_be_visible()
        page.get_by_label("Token").fill("not it")
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("alert")).to_contain_text("not the console's token")
        screenshot(page, tmp_path, "login")
        page.get_by_label("Token").fill(token)
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Ports", exact=True)).to_be_visible()
        jar = page.context.cookies()
        assert jar and all(token not in c["value"] for c in jar), "the browser never keeps the token"
        assert token not in page.content()


# The CSRF check is the console's HTTP layer, whatever the transport behind it.
@on_embedded
def test_an_action_without_the_csrf_token_or_by_get_changes_nothing(backend: Backend) -> None:
    queue = backend.q("IN")
    settings = work_settings(backend, queue)
    with backend.container(settings) as container, console(backend, settings) as base:
        status, headers, page_html = request(base, "GET", "/")
        assert status == 200
        assert "default-src 'self'" in headers["content-security-policy"]
        csrf = csrf_of(page_html)
        cookie = f"mdb_csrf={cookies_of(headers)['mdb_csrf']}"

        for body, sent in (({}, {"Cookie": cookie}),
                           ({"csrf_token": "forged"}, {"Cookie": cookie}),
                           ({"csrf_token": csrf}, {})):  # a token without its cookie: another site's
            status, _, text = request(base, "POST", "/ports/Work/stop", body, sent)
            assert status == 403 and "CSRF" in text
        assert request(base, "GET", "/ports/Work/stop")[0] == 405
        time.sleep(1.0)
        assert container.port_state("Work")["state"] == "started"
        store = Store(backend.settings(settings).container)
        try:
            assert "Work" not in Control(store).wanted(), "no switch was written"
        finally:
            store.dispose()
        taken = base.removeprefix("http://")
        line = one_line_error(mdb("console", "--bind", taken, settings=settings, env=backend.env), 1)
        assert f"cannot bind {taken}" in line

        status, _, text = request(base, "POST", "/queues/purge",
                                  {"csrf_token": csrf, "queue": backend.q("DLQ")}, {"Cookie": cookie})
        assert status == 200 and "Confirm" in text, "a purge with no confirmation asks on a page"
        assert history(backend, settings) == []

        status, headers, _ = request(base, "POST", "/ports/Work/stop", {"csrf_token": csrf},
                                     {"Cookie": cookie})
        assert status == 303
        assert request(base, "POST", "/ports/Work/stop", None,
                       {"Cookie": cookie, "X-CSRF-Token": csrf})[0] == 303, "the header serves too"
        wait_for(lambda: container.port_state("Work")["state"] == "stopped", what="Work stopped")
        assert [a.action for a in history(backend, settings)] == ["stop", "stop"]


def test_a_page_that_rebinds_its_name_to_loopback_cannot_list_or_purge(rabbit: Backend) -> None:
    """DNS rebinding: a page the operator visits points its own name at 127.0.0.1 and talks to the
    console as its own origin. The console answers only the names it is reached by on this machine,
    and refuses a POST that another site's page sent (its Origin)."""
    settings = work_settings(rabbit, rabbit.q("IN"))
    dlq = rabbit.q("DLQ")
    with rabbit.producer(settings) as producer:
        producer.send(dlq, {"n": 1}, message_id="kept-1",
                      headers={"x-mdb-original-destination": rabbit.q("IN")})
    with console(rabbit, settings) as base:
        port = base.rsplit(":", 1)[1]
        status, headers, page_html = request(base, "GET", "/queues")
        assert status == 200 and "kept-1" in page_html
        csrf, cookie = csrf_of(page_html), f"mdb_csrf={cookies_of(headers)['mdb_csrf']}"
        attacker = {"Host": f"rebind.attacker.example:{port}"}
        for path in ("/", "/queues", "/message?" + urlencode({"queue": dlq, "id": "kept-1"}),
                     "/history", "/ports/rows"):
            status, _, text = request(base, "GET", path, headers=attacker)
            assert status == 400 and "kept-1" not in text and "csrf_token" not in text, (path, status)
            assert "rebind.attacker.example" in text, "the refusal names the Host it refused"
        form = {"csrf_token": csrf, "queue": dlq, "confirmed": "yes"}
        status, _, _ = request(base, "POST", "/queues/purge", form, {**attacker, "Cookie": cookie})
        assert status == 400, "a purge through the rebound name is refused, token or not"
        status, _, text = request(base, "POST", "/queues/purge", form,
                                  {"Cookie": cookie, "Origin": "http://rebind.attacker.example"})
        assert status == 403 and "Origin" in text, "a POST sent by another site's page is refused"
        status, _, text = request(base, "POST", "/queues/purge", form,
                                  {"Cookie": cookie, "Sec-Fetch-Site": "cross-site"})
        assert status == 403 and "Sec-Fetch-Site" in text
        assert rabbit.probe(settings).count(dlq) == 1, "nothing was purged"
        assert history(rabbit, settings) == []
        for name in ("localhost", "127.0.0.1", "LOCALHOST."):
            assert request(base, "GET", "/", headers={"Host": f"{name}:{port}"})[0] == 200, name
        status, _, _ = request(base, "POST", "/queues/purge", form,
                               {"Cookie": cookie, "Origin": f"http://localhost:{port}",
                                "Host": f"localhost:{port}"})
        assert status == 303, "the console's own page may purge"
    assert rabbit.probe(settings).count(dlq) == 0


def test_a_session_cookie_that_is_not_ascii_is_refused_with_401(rabbit: Backend) -> None:
    settings = work_settings(rabbit, rabbit.q("IN"))
    port = free_port()
    with console(rabbit, settings, bind=f"0.0.0.0:{port}", env={"MDB_CONSOLE__TOKEN": "tok-1"}) as base:
        status, _, body = request(base, "GET", "/", headers={"Cookie": "mdb_session=caf\xe9"})
        assert status == 401, f"a cookie the console never set is a refusal, not an error: {status}"
        assert 'type="password"' in body
        assert request(base, "GET", "/", headers={"Authorization": "Bearer caf\xe9"})[0] == 401


# -- History of the CLI's actions ---------------------------------------------------------------


# What the CLI writes in the history is the same on either database; the history on PostgreSQL is
# read back by the page tests above (RabbitMQ + PostgreSQL).
@on_embedded
def test_the_cli_records_its_stops_starts_replays_and_purges_in_the_history(backend: Backend) -> None:
    settings = work_settings(backend, backend.q("IN"))
    dlq = backend.q("DLQ")
    for args in (("port", "stop", "Work"), ("port", "start", "Work"), ("dlq", "replay", "--all"),
                 ("dlq", "replay", "nowhere-1"), ("dlq", "purge", "--yes")):
        mdb(*args, settings=settings, env=backend.env)
    actions = history(backend, settings)
    assert [(a.action, a.target, a.detail) for a in actions] == [
        ("purge", dlq, "purged 0 message(s)"),
        ("replay", dlq, "replayed 0 message(s) (nowhere-1); not found: nowhere-1"),
        ("replay", dlq, "replayed 0 message(s) (all)"),
        ("start", "Work", "started requested"),
        ("stop", "Work", "stopped requested"),
    ], "newest first"
    assert all(a.origin == f"cli on {socket.gethostname()}" for a in actions)


# Masking is the console's drawing of the texts, whatever the broker that kept them.
@on_embedded
def test_no_password_of_a_url_reaches_a_page(backend: Backend) -> None:
    settings = work_settings(backend, backend.q("IN"))
    dlq = backend.q("DLQ")
    secret = "amqp://orders:hunter2@mq1//"
    with backend.producer(settings) as producer:  # a backed-out message whose texts carry a URL
        producer.send(dlq, {"callback": secret}, message_id="leaky",
                      headers={"x-mdb-exception": f"RuntimeError: cannot reach {secret}",
                               "x-mdb-original-destination": backend.q("IN"), "x-note": secret})
    with console(backend, settings) as base:
        pages = [request(base, "GET", path)[2] for path in (
            "/queues", "/message?" + urlencode({"queue": dlq, "id": "leaky"}),
            "/message?" + urlencode({"queue": dlq, "id": "leaky", "full": "1"}))]
    assert all("leaky" in text for text in pages)
    assert "amqp://orders:***@mq1//" in pages[1], "the URL is shown, its password masked"
    assert not [text for text in pages if "hunter2" in text]


def test_the_chart_counts_deliveries_per_bucket_and_takes_a_restart_for_a_new_count() -> None:
    from mdbcontainer.console.fleet import BUCKETS, Chart, Rates

    def rows(handled: int, failed: int) -> list[dict[str, Any]]:
        return [{"container": "c1", "port": "Orders", "handled": handled, "failed": failed}]

    rates = Rates()
    for at, handled, failed in ((1000, 0, 0), (1002, 5, 1), (1015, 8, 1), (1020, 2, 0)):
        rates.observe(rows(handled, failed), now=at)  # the last: the container restarted, from 0
    series = rates.series(("c1", "Orders"), now=1020)
    assert len(series) == BUCKETS
    assert series[-2:] == [(5, 1), (3 + 2, 0)]
    assert sum(h + f for h, f in series[:-2]) == 0
    chart = Chart.of(series)
    assert (chart.total_handled, chart.total_failed) == (10, 1)
    assert len(chart.handled) == 2 and len(chart.failed) == 1
    assert all(bar.y >= 0 and bar.y + bar.height <= Chart.HEIGHT for bar in chart.handled)
    rates.observe(rows(2, 0), now=1400)
    assert rates.series(("c1", "Orders"), now=1400) == [(0, 0)] * BUCKETS, "older than 5 minutes: gone"


def test_without_the_console_extra_the_command_says_what_to_install(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()  # a uvicorn that is not there, as on an install without the extra
    (hidden / "uvicorn.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    settings = tmp_path / "settings.toml"
    settings.write_text('[container]\nbroker_url = "embedded://broker.db"\n')
    result = mdb("console", settings=settings, env={"PYTHONPATH": f"{hidden}{os.pathsep}{ROOT}"})
    line = one_line_error(result, 2)
    assert "uvicorn" in line and "pip install 'mdbcontainer[console]'" in line
