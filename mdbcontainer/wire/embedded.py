"""The embedded broker (``embedded://PATH``): RabbitMQ's names and guarantees in one SQLite file.

The broker itself is ``mdbcontainer.embedded`` (a kombu virtual transport);
this module is its side of the wire: no confirms (a publish is a committed
insert), no channel transactions, no heartbeats (nothing on a network to
lose), an exclusive consumer as a file lock beside the file, and queue
counts that include the unacknowledged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import kombu
import tenacity

from ..settings import EMBEDDED_DEFAULT_FILE
from .transport import Capabilities, Transport

if TYPE_CHECKING:
    from ..settings import PortSettings, Settings

EMBEDDED = "embedded://"
EMBEDDED_CAPS = Capabilities("embedded", False, True, False, False, counts_unacknowledged=True,
                             heartbeats=False, local_file=True, partitions=False,
                             strict_redeclare=False)


class EmbeddedTransport(Transport):
    """``embedded://PATH``: the SQLite broker of this package."""

    schemes = ("embedded",)
    capabilities = EMBEDDED_CAPS

    @property
    def path(self) -> str:
        """The broker's SQLite file (its default when the URL names none)."""
        return self.url[len(EMBEDDED):] or EMBEDDED_DEFAULT_FILE

    def connection(self, url: str, *, confirms: bool, heartbeat: int, timeout: float,
                   polling_interval: float | None) -> kombu.Connection:
        from .. import embedded

        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        polling = {} if polling_interval is None else {"polling_interval": polling_interval}
        return kombu.Connection(hostname=str(path), transport=embedded.Transport,
                                transport_options=polling)

    def declare(self, declare: Callable[[], None], name: str) -> None:
        """The embedded transport's race on a first declare from two processes: try again."""
        tenacity.Retrying(stop=tenacity.stop_after_attempt(5), reraise=True,
                          wait=tenacity.wait_incrementing(0.05, 0.05))(declare)

    def refusals(self, settings: Settings, ports: Mapping[str, PortSettings]) -> list[str]:
        """Partitions are refused at binding already, with their own hint (handlers/binding.py)."""
        return [line for line in super().refusals(settings, ports) if ".partitions:" not in line]
