"""A handler the container cannot call is a listener error at bind time (README: The `mdb` command).

``mdb check`` and ``mdb run`` exit 2 with one line naming the handler, before a
message is consumed; the two forms the container calls, ``(message_or_body,
ctx)`` and ``(message_or_body)``, both work.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mdbcontainer.sending.producer import Producer
from mdbcontainer.settings import load_settings
from mdbcontainer.testing import ContainerProcess, QueueProbe, mdb, wait_for, write_settings
from tests.conftest import mdb_here, one_line_error

HEADER = """
from pydantic import BaseModel
from mdbcontainer import Message, MessageContext, message_driven

class Order(BaseModel):
    order_id: int
"""

BAD = {
    "no_parameter": ("def handler() -> None: ...", "it takes no parameter"),
    "three_required": ("def handler(message: Message, ctx: MessageContext, extra: int) -> None: ...",
                       "it requires 3 parameters (message, ctx, extra)"),
    "keyword_only": ("def handler(message: Message, *, tenant: str) -> None: ...",
                     "it requires the keyword-only parameter 'tenant'"),
    "bean_without_message": (
        "class handler:\n    def on_message(self) -> None: ...", "it takes no parameter"),
    "batch_of_one": ("def handler(order: Order, ctx: MessageContext) -> None: ...",
                     "annotated list[X], but its first parameter is Order"),
}


def listener(folder: Path, module: str, handler: str, batch: bool = False) -> Path:
    decorator = '@message_driven("Sig", batch=True)' if batch else '@message_driven("Sig")'
    (folder / f"{module}.py").write_text(HEADER + f"\n{decorator}\n" + textwrap.dedent(handler) + "\n")
    return write_settings(folder / "settings.toml", {
        "container": {"broker_url": f"embedded://{folder / 'broker.db'}",
                      "database_url": f"sqlite:///{folder / 'container.db'}",
                      "listeners": [module], "control_interval": "200ms"},
        "ports": {"Sig": {"destination": "SIG"}},
    })


# Async handlers are awaited on their port's event loop (test_async.py); what the container could
# not await is refused at binding, naming the handler.
ASYNC_REFUSED = {
    "async_generator": ("async def handler(message: Message) -> None:\n    yield", False,
                        "must return, not yield"),
    "async_setup_of_a_def_bean": ("class handler:\n    async def setup(self) -> None: ...\n"
                                  "    def on_message(self, message: Message) -> None: ...", False,
                                  "async def setup needs an async def on_message"),
}


@pytest.mark.parametrize("case", sorted(ASYNC_REFUSED))
@pytest.mark.parametrize("command", ["check", "run"])
def test_an_async_handler_the_container_cannot_await_is_refused_naming_it(
        tmp_path: Path, case: str, command: str) -> None:
    handler, batch, problem = ASYNC_REFUSED[case]
    settings = listener(tmp_path, f"sig_{case}", handler, batch=batch)
    with Producer.from_settings(load_settings(settings, environ={})) as producer:
        producer.send("SIG", {"order_id": 1})
    result = (mdb_here(command, settings=settings, cwd=tmp_path) if command == "check"  # no start-up
              else mdb(command, "-c", str(settings), cwd=tmp_path, timeout=60))
    line = one_line_error(result, 2)
    assert f"sig_{case}:handler" in line and problem in line, line
    assert QueueProbe(load_settings(settings, environ={})).count("SIG") == 1  # nothing acked


@pytest.mark.slow
@pytest.mark.parametrize("form", ["function", "bean"])
def test_an_async_handler_is_awaited_not_acknowledged_unprocessed(tmp_path: Path, form: str) -> None:
    """Before async support its coroutine was never awaited and the message acked as handled."""
    out = tmp_path / "seen.jsonl"
    body = f"""
    await asyncio.sleep(0.01)
    with open({str(out)!r}, "a") as f:
        f.write(order.model_dump_json() + "\\n")"""
    if form == "function":
        handler = "async def handler(order: Order) -> None:\n    import asyncio" + body
    else:
        handler = ("class handler:\n    async def on_message(self, order: Order) -> None:\n"
                   "        import asyncio" + textwrap.indent(body, "    "))
    settings = listener(tmp_path, f"sig_async_{form}", handler)
    with ContainerProcess(settings, cwd=tmp_path).start():
        with Producer.from_settings(load_settings(settings, environ={})) as producer:
            producer.send("SIG", {"order_id": 7})
        wait_for(out.exists, what="the handler's output")
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"order_id": 7}]


@pytest.mark.parametrize("case", sorted(BAD))
def test_check_refuses_a_handler_it_cannot_call_naming_it(tmp_path: Path, case: str) -> None:
    handler, problem = BAD[case]
    settings = listener(tmp_path, f"sig_{case}", handler, batch=case.startswith("batch"))
    result = mdb_here("check", settings=settings, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line_error(result)
    assert f"sig_{case}:handler" in line and problem in line, line


def test_run_exits_2_before_consuming_anything(tmp_path: Path) -> None:
    settings = listener(tmp_path, "sig_run", BAD["three_required"][0])
    with Producer.from_settings(load_settings(settings, environ={})) as producer:
        producer.send("SIG", {"order_id": 1})
    result = mdb("run", "-c", str(settings), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "sig_run:handler" in one_line_error(result)
    assert QueueProbe(load_settings(settings, environ={})).count("SIG") == 1


def test_the_two_callable_forms_and_a_batch_handler_pass_check(tmp_path: Path) -> None:
    for module, handler, batch in (
        ("sig_body_only", "def handler(order: Order) -> None: ...", False),
        ("sig_ctx_optional", "def handler(order: Order, ctx: MessageContext | None = None) -> None: ...",
         False),
        ("sig_bean", "class handler:\n    def on_message(self, message: Message) -> None: ...", False),
        ("sig_batch", "def handler(orders: list[Order], ctx: MessageContext) -> None: ...", True),
    ):
        settings = listener(tmp_path, module, handler, batch)
        result = mdb_here("check", settings=settings, cwd=tmp_path)
        assert result.returncode == 0, (module, result.stderr)


@pytest.mark.slow
def test_a_handler_taking_only_the_body_is_called_with_it(tmp_path: Path) -> None:
    out = tmp_path / "seen.jsonl"
    handler = f"""
    def handler(order: Order) -> None:
        with open({str(out)!r}, "a") as f:
            f.write(order.model_dump_json() + "\\n")
    """
    settings = listener(tmp_path, "sig_one", handler)
    with ContainerProcess(settings, cwd=tmp_path).start():
        with Producer.from_settings(load_settings(settings, environ={})) as producer:
            producer.send("SIG", {"order_id": 7})
        wait_for(out.exists, what="the handler's output")
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"order_id": 7}]
