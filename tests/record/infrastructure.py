"""The record's own services: a RabbitMQ cluster, a PostgreSQL pair and a test host.

All on spare ports and folders of their own (tests/chaos/cluster.py,
tests/record/postgres.py, tests/chaos/hosts.py), never the machine's
RabbitMQ on 5672 or PostgreSQL on 5432. The test host forwards its broker
link to every node and its database link to both servers, so a container on
it reaches the same cluster and pair through links that can be cut.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mdbcontainer.wire.partitions import PLUGIN
from tests.chaos import cluster as rabbit
from tests.chaos import hosts
from tests.record import postgres


class Infrastructure:
    """The record's own cluster, database pair and test host; started once, shared by runs."""

    def __init__(self, synchronous: bool = True, say: Callable[[str], None] = print, *,
                 nodes: int = 3, standby: bool = True, test_host: bool = True) -> None:
        """``nodes``, ``standby`` and ``test_host`` smaller: for runs without broker, database or
        link faults (the checker's own tests), which then start in half the time."""
        self.synchronous = synchronous
        self.say = say
        # The ordered port's partitions are a consistent-hash exchange (CONTRACT section 16).
        self.cluster = rabbit.Cluster(size=nodes, plugins=(PLUGIN,))
        self.database = postgres.Replicated(synchronous=synchronous and standby, with_standby=standby)
        self.test_host = test_host
        self.host: hosts.TestHost | None = None

    def start(self) -> Infrastructure:
        for why in (rabbit.available(), postgres.available()):
            if why:
                raise RuntimeError(why)
        began = time.monotonic()
        boot = threading.Thread(target=self.cluster.start, name="record-cluster")
        boot.start()  # the Erlang VMs boot while PostgreSQL is made
        try:
            self.database.start()
        finally:
            boot.join()
        if not self.cluster.alive():
            raise RuntimeError("the RabbitMQ cluster did not start")
        if self.test_host and hosts.available() is None:
            self.host = hosts.TestHost(services={
                "broker": tuple(node.port for node in self.cluster.nodes),
                "database": tuple(server.port for server in self.database.servers)}).create()
        self.say(f"record: {len(self.cluster.nodes)} RabbitMQ node(s) on {', '.join(str(n.port) for n in self.cluster.nodes)}, "
                 f"PostgreSQL {'synchronous' if self.synchronous else 'asynchronous'} primary "
                 f"{self.database.primary.port}"
                 f"{f' and standby {self.database.standby.port}' if self.database.with_standby else ''}, test host "
                 f"{self.host.name if self.host else 'none (no ip netns here: no link cuts)'} "
                 f"({time.monotonic() - began:.0f}s)")
        return self

    def broker_url(self, remote: bool) -> str:
        if remote and self.host:
            return ";".join(f"amqp://guest:guest@{self.host.address('broker')}:{n.port}//"
                            for n in self.cluster.nodes)
        return self.cluster.broker_url

    def database_url(self, remote: bool) -> str:
        url = self.database.url
        if remote and self.host:
            url = url.replace("127.0.0.1", self.host.address("database"))
        return url

    def heal(self) -> None:
        """Every broker node running and every link carrying packets: the end of a run."""
        if self.host:
            self.host.heal()
        for node in self.cluster.nodes:
            if node not in self.cluster.alive():
                self.cluster.restart(node)
        try:
            self.database.heal()
        except Exception as exc:  # the primary still takes writes: the check can go on
            self.say(f"the standby could not be rebuilt: {exc}")

    def remove(self) -> None:
        if self.host:
            self.host.remove()
        self.cluster.remove()
        self.database.remove()



@contextmanager
def infrastructure(synchronous: bool, say: Callable[[str], None] = print) -> Iterator[Infrastructure]:
    infra = Infrastructure(synchronous, say)
    try:
        yield infra.start()
    finally:
        infra.remove()
