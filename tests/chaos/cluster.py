"""A 3-node RabbitMQ cluster started by a test, beside the machine's own broker.

Each node is ``rabbitmq-server -detached`` run as the rabbitmq user with a node
name, AMQP port, distribution port, configuration, plugins file, mnesia and
log folders of its own (under a fresh folder of /tmp owned by that user), so
the machine's node (``rabbit@localhost`` on 5672) is never touched. Nodes 2
and 3 join node 1 with ``rabbitmqctl join_cluster``. :meth:`Cluster.kill`
is a SIGKILL of a node's Erlang VM; :meth:`Cluster.remove` kills every node
and deletes its folders.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

USER = "rabbitmq"


def available() -> str | None:
    """Why a cluster cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "a test cluster needs root (to run nodes as the rabbitmq user)"
    if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
        return "a test cluster needs rabbitmq-server and rabbitmqctl"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"a test cluster needs the {USER!r} user"
    return None


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on (and, bound once here, that nothing else picks meanwhile)."""
    ports: list[int] = []
    sockets = []
    while len(ports) < count:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


@dataclass
class Node:
    name: str
    port: int
    dist_port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def env(self) -> dict[str, str]:
        return {
            "HOME": pwd.getpwnam(USER).pw_dir,
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.folder / "pid"),
        }

    def pid(self) -> int | None:
        with suppress(OSError, ValueError):
            return int((self.folder / "pid").read_text().strip())
        return None


@dataclass
class Cluster:
    """Three RabbitMQ nodes joined in one cluster, on spare ports."""

    size: int = 3
    plugins: tuple[str, ...] = ()  # enabled on every node (the record's ordered ports: consistent hash)
    nodes: list[Node] = field(default_factory=list)
    root: Path | None = None

    def start(self, timeout: float = 120.0) -> Cluster:
        self.root = Path(tempfile.mkdtemp(prefix="mdb-cluster-"))
        self.root.chmod(0o755)
        tag = uuid.uuid4().hex[:6]
        ports = _free_ports(2 * self.size)
        for i in range(self.size):
            folder = self.root / f"n{i + 1}"
            (folder / "mnesia").mkdir(parents=True)
            (folder / "log").mkdir()
            node = Node(f"mdb{tag}n{i + 1}@localhost", ports[2 * i], ports[2 * i + 1], folder)
            (folder / "rabbitmq.conf").write_text(
                f"listeners.tcp.local = 127.0.0.1:{node.port}\nloopback_users = none\n"
            )
            (folder / "enabled_plugins").write_text(f"[{','.join(self.plugins)}].\n")
            self.nodes.append(node)
        subprocess.run(["chown", "-R", f"{USER}:{USER}", str(self.root)], check=True)
        for node in self.nodes:
            self._as_user(node, ["rabbitmq-server", "-detached"])
        with ThreadPoolExecutor(self.size) as pool:
            list(pool.map(lambda n: self._await(n, timeout), self.nodes))
        others = self.nodes[1:]
        with ThreadPoolExecutor(self.size) as pool:
            list(pool.map(lambda n: self.ctl(n, "stop_app"), others))
        for node in others:  # one at a time: joins at once race in mnesia
            self.ctl(node, "join_cluster", self.nodes[0].name)
        with ThreadPoolExecutor(self.size) as pool:
            list(pool.map(lambda n: self.ctl(n, "start_app"), others))
        return self

    def _await(self, node: Node, timeout: float) -> None:
        """``rabbitmqctl wait PIDFILE``: for the node to write its pid, then to boot."""
        try:
            self.ctl(node, "wait", str(node.folder / "pid"), "--timeout", str(int(timeout)))
        except RuntimeError as exc:
            log = next((node.folder / "log").glob("*@localhost.log"), None)
            tail = log.read_text(errors="replace")[-1500:] if log else "(no log)"
            raise RuntimeError(f"{node.name} did not start: {exc}\n{tail}") from None

    def _as_user(self, node: Node, command: list[str], timeout: float = 120.0) -> str:
        done = subprocess.run(["runuser", "-u", USER, "--", "env", *(f"{k}={v}" for k, v in
                                                                     node.env.items()), *command],
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} on {node.name}: "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
        return done.stdout

    def ctl(self, node: Node, *args: str, via: Node | None = None) -> str:
        """``rabbitmqctl -n NODE ARGS`` (asking ``via`` instead, when given)."""
        target = via or node
        return self._as_user(target, ["rabbitmqctl", "-q", "-n", target.name, *args])

    @property
    def broker_url(self) -> str:
        """Every node, separated by ``;``: the container's failover URL."""
        return ";".join(node.url for node in self.nodes)

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.pid() is not None and _running(n.pid())]

    def leader(self, queue: str) -> Node:
        """The node that leads quorum queue ``queue`` (asked of any live node)."""
        live = self.alive()[0]
        out = self.ctl(live, "list_queues", "name", "leader", "--no-table-headers")
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return next(n for n in self.nodes if n.name == parts[1])
        raise RuntimeError(f"queue {queue!r} has no leader in: {out!r}")

    def kill(self, node: Node) -> None:
        """SIGKILL the node's Erlang VM: its sockets close, the others see it go."""
        pid = node.pid()
        assert pid is not None, f"{node.name} has no pid file"
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def restart(self, node: Node, timeout: float = 120.0) -> None:
        """Start a killed node again: it rejoins its cluster from its own mnesia folder."""
        (node.folder / "pid").unlink(missing_ok=True)
        self._as_user(node, ["rabbitmq-server", "-detached"])
        self._await(node, timeout)

    def remove(self) -> None:
        """Kill every node of this cluster and delete its folders."""
        for node in self.nodes:
            pid = node.pid()
            if pid is not None and _running(pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: its sockets are closed.
    with suppress(OSError):
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    return False
