"""Helpers the behaviour tests share: an ``mdb console`` process and plain HTTP requests to it,
a scrape of ``/metrics``, a free port, ``rabbitmqctl`` tables (a test module imports none of
another test module: tests/test_layout.py)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from mdbcontainer.testing import wait_for
from tests.conftest import ROOT, Backend, rabbitmqctl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()



def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    status, text = get(port, "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }



@contextmanager
def console(backend: Backend, settings: Path, bind: str | None = None,
            env: dict[str, str] | None = None) -> Iterator[str]:
    """``mdb console`` as a process on ``settings``; yields its base URL, stops it at the end."""
    bind = bind or f"127.0.0.1:{free_port()}"
    log = settings.with_name("console.log")
    command = [sys.executable, "-m", "mdbcontainer", "console", "-c", str(settings), "--bind", bind]
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, **backend.env, **(env or {})})
    port = int(bind.rsplit(":", 1)[1])

    def serving() -> bool:
        assert proc.poll() is None, f"mdb console exited {proc.returncode}: {log.read_text()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            return False

    try:
        wait_for(serving, 30, 0.1, "mdb console to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)



def request(base: str, method: str, path: str, body: dict[str, str] | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """One plain HTTP request, redirects not followed: status, headers, body."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = urlencode(body) if body is not None else None
    sent = {**({"Content-Type": "application/x-www-form-urlencoded"} if data else {}), **(headers or {})}
    conn.request(method, path, body=data, headers=sent)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    headers: dict[str, str] = {}
    for key, value in response.getheaders():  # several Set-Cookie headers: kept, comma-separated
        key = key.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return response.status, headers, text



def table(*args: str) -> list[list[str]]:
    """The rows of a ``rabbitmqctl list_*`` command, one list of columns each."""
    out = rabbitmqctl(*args, "--quiet", "--no-table-headers", timeout=30)
    return [line.split("\t") for line in out.splitlines() if "\t" in line]



def consumer_connection(queue: str) -> str:
    """The process id of the one broker connection consuming ``queue`` (``rabbitmqctl close_connection``)."""
    [channel] = [row[1] for row in table("list_consumers", "queue_name", "channel_pid") if row[0] == queue]
    [connection] = [row[1] for row in table("list_channels", "pid", "connection") if row[0] == channel]
    return connection
