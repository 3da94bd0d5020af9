"""Test hosts: network namespaces joined to this machine, whose links can go silent.

A :class:`TestHost` is a network namespace with two veth pairs to the host,
one carrying its broker traffic and one its database traffic, and ``socat``
forwarders on the host ends to the machine's RabbitMQ and PostgreSQL on
127.0.0.1. A container started in it (``prefix``) reaches the services only
through those links. :meth:`TestHost.cut` makes a link silent with blackhole
routes on both sides (packets vanish, nobody is told, as on a real network
cut: ``ip link set down`` is not silent, sends fail at once);
:meth:`TestHost.heal` takes them away. The addresses come from the benchmark
range 198.18.0.0/15 and exist only on these veth pairs, so nothing else on the
machine sees them; :meth:`TestHost.remove` tears everything down.

Needs root (``ip netns``), ``socat`` and the ``ip`` command.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import uuid
from contextlib import suppress
from dataclasses import dataclass, field

SERVICES = {"broker": 5672, "database": 5432}


def available() -> str | None:
    """Why test hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "test hosts need root (ip netns add)"
    for tool in ("ip", "socat"):
        if shutil.which(tool) is None:
            return f"test hosts need the {tool!r} command"
    return None


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 198.18.0.0/15 that no interface of this machine uses."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    used = [ipaddress.IPv4Interface(word).network for line in out.splitlines()
            for before, word in zip(line.split(), line.split()[1:], strict=False) if before == "inet"]
    for _ in range(100):
        subnet = ipaddress.IPv4Network((int(ipaddress.IPv4Address("198.18.0.0"))
                                        + 4 * random.randrange(1, 32767), 30))
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise RuntimeError("no free /30 in 198.18.0.0/15")


@dataclass
class Link:
    """One veth pair: the host end (where a forwarder listens) and the namespace end."""

    service: str
    host_if: str
    ns_if: str
    host_addr: str
    ns_addr: str
    cut: bool = False


@dataclass
class TestHost:
    """A network namespace reaching RabbitMQ and PostgreSQL through links that can go silent."""

    name: str = field(default_factory=lambda: f"mdb-{uuid.uuid4().hex[:8]}")
    # The ports each link forwards to 127.0.0.1 (the record's cluster nodes and database servers).
    services: dict[str, tuple[int, ...]] = field(
        default_factory=lambda: {service: (port,) for service, port in SERVICES.items()})
    links: dict[str, Link] = field(default_factory=dict)
    forwarders: list[subprocess.Popen[bytes]] = field(default_factory=list)

    __test__ = False  # not a test class, whatever its name says

    def create(self) -> TestHost:
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")
        tag = self.name[-6:]
        for index, (service, ports) in enumerate(self.services.items()):
            subnet = _free_subnet()
            host_addr, ns_addr = (str(a) for a in list(subnet.hosts())[:2])
            link = Link(service, f"mh{index}{tag}", f"mn{index}{tag}", host_addr, ns_addr)
            self.links[service] = link
            ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
            ip("link", "set", link.ns_if, "netns", self.name)
            ip("addr", "add", f"{host_addr}/30", "dev", link.host_if)
            ip("link", "set", link.host_if, "up")
            ip("-n", self.name, "addr", "add", f"{ns_addr}/30", "dev", link.ns_if)
            ip("-n", self.name, "link", "set", link.ns_if, "up")
            for port in ports:
                self._forward(host_addr, port)
        return self

    def _forward(self, address: str, port: int) -> None:
        """socat on the host end: each connection from the namespace to the service on loopback."""
        proc = subprocess.Popen(
            ["socat", f"TCP-LISTEN:{port},bind={address},fork,reuseaddr", f"TCP:127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self.forwarders.append(proc)
        deadline = time.monotonic() + 10
        while True:
            with suppress(OSError), socket.create_connection((address, port), timeout=1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"socat forwarder on {address}:{port} did not start")
            time.sleep(0.05)

    def address(self, service: str) -> str:
        """Where the namespace reaches ``service`` ("broker" or "database")."""
        return self.links[service].host_addr

    @property
    def prefix(self) -> list[str]:
        """Runs a command on this test host (``ip netns exec`` keeps the command's pid)."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, *services: str) -> None:
        """Make the links of ``services`` (default: all) silent, on both sides."""
        for service in services or tuple(self.links):
            link = self.links[service]
            ip("route", "add", "blackhole", f"{link.ns_addr}/32")
            ip("-n", self.name, "route", "add", "blackhole", f"{link.host_addr}/32")
            link.cut = True

    def heal(self) -> None:
        """Take the blackhole routes away: the links carry packets again."""
        for link in self.links.values():
            if link.cut:
                with suppress(RuntimeError):
                    ip("route", "del", "blackhole", f"{link.ns_addr}/32")
                with suppress(RuntimeError):
                    ip("-n", self.name, "route", "del", "blackhole", f"{link.host_addr}/32")
                link.cut = False

    def remove(self) -> None:
        """Stop the forwarders (and the connections they forked), delete the links and namespace."""
        self.heal()
        for proc in self.forwarders:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.forwarders.clear()
        for link in self.links.values():
            with suppress(RuntimeError):
                ip("link", "del", link.host_if)
        with suppress(RuntimeError):
            ip("netns", "del", self.name)
