"""The handler ``benchmarks/delays.py`` runs inside ``mdb run``: port ``BenchDelayed``.

A message fails its first ``body["fail"]`` deliveries, then inserts its row
(once-only, container-managed). The good messages (``fail`` 0) are timed: the
first good one starts the clock, and the ``$BENCH_N``-th writes the elapsed
seconds (and the consumer thread's CPU seconds, the failing messages' work
included) to ``$BENCH_STAMP``, so the rate measured is the rate of the good
messages, whatever the failing ones do meanwhile.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from listeners_bench import effects_table

from mdbcontainer import Message, MessageContext, message_driven

effects = effects_table(os.environ.get("BENCH_SCHEMA") or None)
_target = int(os.environ.get("BENCH_N", "0"))
_stamp = os.environ.get("BENCH_STAMP", "")
_good = {"count": 0, "first": 0.0, "cpu": 0.0}


@message_driven("BenchDelayed")
def on_message(message: Message, ctx: MessageContext) -> None:
    """Fail while the message's count is under its ``fail``; else one Core insert."""
    if message.redelivery_count < int(message.body.get("fail", 0)):
        raise RuntimeError(f"bench failure {message.redelivery_count + 1} of {message.id}")
    ctx.session.execute(effects.insert().values(message_id=message.id, n=int(message.body["n"])))
    if message.body.get("fail"):
        return
    if _good["count"] == 0:
        _good["first"], _good["cpu"] = time.perf_counter(), time.thread_time()
    _good["count"] += 1
    if _good["count"] == _target and _stamp:
        elapsed, cpu = time.perf_counter() - _good["first"], time.thread_time() - _good["cpu"]
        Path(_stamp).write_text(f"{elapsed!r} {cpu!r}\n")
