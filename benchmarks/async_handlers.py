"""Async handlers against their baselines (README, "Async handlers"), on RabbitMQ + PostgreSQL.

```
.venv/bin/python benchmarks/async_handlers.py [--n 20000] [--n-sync 500] [--rounds 1]
    [--scenario io|once|none|rss|all] [--rss-total 200000]
```

Scenarios (each round runs the contestants of a scenario one after another, so
the rounds interleave them):

| scenario | baseline | container | target |
| --- | --- | --- | --- |
| `io` | min(the hand-written kombu consumer's rate, 100 / 0.02 s) | `BenchAsyncSleep`: `await asyncio.sleep(0.02)`, transaction none, concurrency 100 | >= 0.6 |
| `once` | `BenchSyncSleepOnce`: the same handler written with `def` and `time.sleep(0.02)`, once-only CMT, concurrency 1 (`--n-sync` messages) | `BenchAsyncOnce`: once-only CMT on PostgreSQL, concurrency 50 | >= 10 |
| `none` | the hand-written kombu consumer (ack per message) | `BenchAsyncNone`: a trivial `async def`, transaction none (the same handler with `def`, `BenchNone`, is printed beside it) | >= 0.85 |
| `rss` | - | `BenchAsyncSleep` at concurrency 100: RSS after `--n` messages and after `--rss-total` | within 10% |

It reuses ``throughput.py``'s harness: the container starts with its port
stopped, the queue is loaded, the port started, and the handler stamps the
time from its first message to its N-th.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import throughput as tp  # noqa: E402

WAIT = 0.02


def rate(bench: tp.Bench, name: str, n: int) -> float:
    wall, _cpu = tp.contestant(name)(bench, n)
    return n / wall


def scenario(bench: tp.Bench, name: str, args: argparse.Namespace) -> tuple[str, float, float, str]:
    """(what, baseline rate, container rate, target) of one round of ``name``."""
    n = args.n
    if name == "io":
        plain = rate(bench, "plain", n)
        ours = rate(bench, "BenchAsyncSleep", n)
        bound = min(plain, 100 / WAIT)
        return (f"io: async sleep 20ms, none, concurrency 100 vs min(kombu {plain:,.0f}, 5,000)",
                bound, ours, ">= 0.60")
    if name == "once":
        sync = rate(bench, "BenchSyncSleepOnce", args.n_sync)
        ours = rate(bench, "BenchAsyncOnce", n)
        return ("once: CMT once-only PG, async c=50 vs def c=1 (same 20ms wait)", sync, ours, ">= 10")
    plain = rate(bench, "plain", n)
    ours = rate(bench, "BenchAsyncNone", n)
    sync = rate(bench, "BenchNone", n)
    print(f"  none: the same handler written with def (BenchNone): {sync:,.0f} msg/s; "
          f"async / def {ours / sync:.2f}", flush=True)
    return ("none: trivial async def vs kombu", plain, ours, ">= 0.85")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--n-sync", type=int, default=500, help="messages of the def handler at 50/s")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scenario", choices=["io", "once", "none", "rss", "all"], default="all")
    parser.add_argument("--rss-total", type=int, default=200_000)
    args = parser.parse_args()
    names = ["io", "once", "none"] if args.scenario == "all" else [args.scenario]
    print(f"N={args.n} (def handler: {args.n_sync}); load averages before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows: list[tuple[str, float, float, str]] = []
    with tp.services_kept_up():
        bench = tp.Bench(args.n)
        try:
            if names == ["rss"]:
                rss(bench, args)
                return 0
            for _ in range(args.rounds):
                rows += [scenario(bench, name, args) for name in names]
        except Exception as exc:
            print(f"benchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        finally:
            bench.close()
    print(f"\n{'scenario':<72}{'baseline':>10}{'ours':>10}{'ratio':>8}  target")
    for what, base, ours, target in rows:
        print(f"{what:<72}{base:>10,.0f}{ours:>10,.0f}{ours / base:>8.2f}  {target}")
    print(f"\nload averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores, shared with whatever else runs)")
    return 0


def rss(bench: tp.Bench, args: argparse.Namespace) -> None:
    """RSS of ``mdb run`` on the async port after ``--n`` messages and after ``--rss-total``."""
    port, chunk, total = "BenchAsyncSleep", args.n, args.rss_total
    seen: dict[int, int] = {}

    def rss_kb(proc: tp.ContainerProcess) -> int:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))

    def keep_going(proc: tp.ContainerProcess) -> None:
        seen[chunk] = rss_kb(proc)
        handled = chunk
        while handled < total:
            bench.load(chunk, wait=False)
            handled += chunk
            tp.wait_for(lambda target=handled: (proc.port_state(port) or {}).get("handled", 0) >= target,
                        900, 0.5, f"{handled} handled")
        seen[total] = rss_kb(proc)

    tp.container(bench, port, chunk, after=keep_going)
    first, last = seen[chunk], seen[total]
    print(f"\nRSS of mdb run ({port}, async, concurrency 100): {first / 1024:.1f} MiB after {chunk:,} "
          f"messages, {last / 1024:.1f} MiB after {total:,} ({(last / first - 1) * 100:+.1f}%; "
          "target within 10%)")


if __name__ == "__main__":
    sys.exit(main())
