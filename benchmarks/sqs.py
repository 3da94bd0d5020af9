"""Throughput of ``mdb run`` on Amazon SQS (moto's server) beside a hand-written boto3 consumer.

moto is not SQS: a request to moto costs this machine's CPU where one to SQS
costs a network round trip, so the figures are only a ratio of two consumers
in the same run, never SQS's own speed. Each contestant drains the same N
messages from a fresh queue, timed from its first message to its N-th:

- ``boto3``: the hand-written consumer: ``ReceiveMessage`` (10 at a time,
  long polling) and ``DeleteMessageBatch`` of what it received, the trivial
  work between;
- ``none``: a ``transaction = "none"`` port (listeners_bench ``BenchNone``);
- ``batch``: a once-only batch port (``BenchBatch``, batch_size 10: one SQS
  receive) on PostgreSQL: exactly-once at SQS's batch size.

The container starts with its port stopped; the queue is loaded, then
``mdb port start``, so neither start-up nor loading is timed. Goals: ``none``
0.9x of ``boto3``, ``batch`` 0.8x.

    .venv/bin/python benchmarks/sqs.py --n 2000
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mdbcontainer.testing import ContainerProcess, mdb, wait_for, write_settings  # noqa: E402

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TARGETS = {"none": 0.9, "batch": 0.8}


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = spare_port()
    # tests/moto_server.py: moto's server with its delete under the queue's lock (moto 5 can
    # drop a message sent while another is deleted: both consumers would count fewer)
    server = subprocess.Popen([sys.executable, "-m", "tests.moto_server", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=HERE.parent)
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    os.environ.update(env)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, env
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise SystemExit("moto's server did not start") from None
            time.sleep(0.1)


def client() -> Any:
    import boto3

    return boto3.client("sqs")


def load(queue: str, n: int) -> None:
    """N messages as the container's producer would send them: a JSON body and a message id."""
    sqs = client()
    url = sqs.create_queue(QueueName=queue)["QueueUrl"]
    for start in range(0, n, 10):
        sqs.send_message_batch(QueueUrl=url, Entries=[{
            "Id": str(i), "MessageBody": f'{{"n": {i}}}',
            "MessageAttributes": {
                "message_id": {"DataType": "String", "StringValue": f"m-{i}"},
                "content_type": {"DataType": "String", "StringValue": "application/json"},
            },
        } for i in range(start, min(n, start + 10))])


def hand_written(queue: str, n: int) -> float:
    """The boto3 consumer: receive 10, work, delete the batch; first message to the N-th."""
    import json

    sqs = client()
    url = sqs.get_queue_url(QueueName=queue)["QueueUrl"]
    done, first = 0, 0.0
    while done < n:
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                  MessageAttributeNames=["All"]).get("Messages", [])
        if not got:
            continue
        if not first:
            first = time.perf_counter()
        for message in got:
            int(json.loads(message["Body"])["n"])
        sqs.delete_message_batch(QueueUrl=url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)])
        done += len(got)
    return time.perf_counter() - first


def container(tmp: Path, env: dict[str, str], queue: str, n: int, port: str) -> float:
    """``mdb run`` with ``port`` on ``queue``: loaded while stopped, then started; its stamp's seconds."""
    stamp = tmp / f"{port}-{uuid.uuid4().hex[:6]}.stamp"
    schema = f"sqsbench_{uuid.uuid4().hex[:6]}"
    options: dict[str, Any] = {"transaction": "none", "once_only": False}
    database = f"sqlite:///{tmp / 'container.db'}"
    container_keys: dict[str, Any] = {}
    if port == "BenchBatch":
        options = {"transaction": "container", "once_only": True, "batch_size": 10}
        database = POSTGRES_URL
        container_keys["db_schema"] = schema
        _create_schema(schema)
    settings = write_settings(tmp / f"{port}.toml", {
        "container": {"broker_url": "sqs://", "database_url": database,
                      "listeners": ["listeners_bench"], "dead_letter_queue": f"{queue}-DLQ",
                      **container_keys},
        # Every handler of listeners_bench needs a destination (as in throughput.py); one runs.
        "ports": {**{name: {"destination": queue, **keys} for name, keys in _bench_ports().items()},
                  port: {"destination": queue, "prefetch": 20, **options}},
        "queues": {queue: {}},
    })
    cli_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
               "BENCH_SCHEMA": schema if port == "BenchBatch" else ""}
    config = ["-c", str(settings)]
    mdb("port", "stop", port, *config, env=cli_env)
    proc = ContainerProcess(settings, ports=[port], env={**cli_env, "BENCH_N": str(n),
                                                         "BENCH_STAMP": str(stamp)},
                            cwd=HERE, log_path=tmp / f"{port}.log")
    proc.start(wait=False)
    try:
        try:
            wait_for(lambda: proc.port_state(port), 180, 0.2, f"mdb run ({port}) to register")
        except AssertionError:
            print(proc.output()[-2000:])
            raise
        load(queue, n)
        mdb("port", "start", port, *config, env=cli_env)
        wait_for(stamp.exists, 120 + n / 10, 0.1, f"the container to handle {n} messages")
        return float(stamp.read_text().split()[0])
    finally:
        if proc.alive():
            proc.terminate(30)


def _bench_ports() -> dict[str, dict[str, Any]]:
    sys.path.insert(0, str(HERE))
    from throughput import PORTS

    return PORTS


def _create_schema(schema: str) -> None:
    from sqlalchemy import create_engine, text

    sys.path.insert(0, str(HERE))
    import listeners_bench as lb

    engine = create_engine(POSTGRES_URL)
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    lb.effects_table(schema).create(engine)
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="messages per contestant")
    parser.add_argument("--scenario", choices=["none", "batch", "all"], default="all")
    args = parser.parse_args()
    print(f"N={args.n}; load averages before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    server, env = start_moto()
    results: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mdb-sqs-bench-") as folder:
            tmp = Path(folder)
            base = f"bench-{uuid.uuid4().hex[:6]}"
            load(f"{base}-plain", args.n)
            results["boto3"] = args.n / hand_written(f"{base}-plain", args.n)
            if args.scenario in ("none", "all"):
                results["none"] = args.n / container(tmp, env, f"{base}-none", args.n, "BenchNone")
            if args.scenario in ("batch", "all"):
                results["batch"] = args.n / container(tmp, env, f"{base}-batch", args.n, "BenchBatch")
    finally:
        server.kill()
    print(f"{'contestant':<12}{'msgs/s':>10}{'ratio':>8}{'target':>8}")
    for name, rate in results.items():
        ratio = rate / results["boto3"]
        target = f">={TARGETS[name]:.2f}" if name in TARGETS else ""
        print(f"{name:<12}{rate:>10,.0f}{ratio:>8.2f}{target:>8}")
    print(f"load averages after: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          "(moto is not SQS: the figures are a ratio of two consumers in the same run)")


if __name__ == "__main__":
    main()
