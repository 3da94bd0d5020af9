"""``[container] metadata``: the application's tables exist before the first delivery."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from mdbcontainer.testing import mdb, wait_for, write_settings
from tests.conftest import Backend, one_line_error

MODELS = '''
import os

from sqlalchemy import Integer, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from mdbcontainer import MessageContext, message_driven


class Base(DeclarativeBase):
    metadata = MetaData(schema=os.environ.get("MDB_TEST_SCHEMA") or None)


class Shipment(Base):
    __tablename__ = "shipments"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    carrier: Mapped[str] = mapped_column(String(40))


@message_driven("Ship")
def ship(body: dict, ctx: MessageContext) -> None:
    ctx.session.add(Shipment(id=body["id"], carrier=body["carrier"]))
'''


def app(folder: Path, backend: Backend | None = None, **container: str) -> Path:
    (folder / "shipping.py").write_text(textwrap.dedent(MODELS))
    if backend is not None:
        return backend.write(ports={"Ship": {"destination": backend.q("SHIP")}},
                             listeners=["shipping"], **container)
    return write_settings(folder / "settings.toml", {
        "container": {"broker_url": f"embedded://{folder / 'b.db'}",
                      "database_url": f"sqlite:///{folder / 'd.db'}",
                      "listeners": ["shipping"], **container},
        "ports": {"Ship": {"destination": "SHIP"}},
    })


@pytest.mark.slow
def test_the_named_metadata_is_created_at_start_and_handlers_write_to_it(backend: Backend) -> None:
    settings = app(backend.tmp, backend, metadata="shipping:Base")
    queue = backend.q("SHIP")
    with backend.container(settings) as container:
        tables = inspect(backend.engine).get_table_names(schema=backend.schema)
        assert "shipments" in tables, "created before the first delivery"
        assert "created 1 table(s) of shipping:Base: shipments" in container.output()
        with backend.producer(settings) as producer:
            producer.send(queue, {"id": 7, "carrier": "post"})
        table = f'"{backend.schema}".shipments' if backend.schema else "shipments"

        def shipped() -> list[tuple[int, str]]:
            with backend.engine.connect() as conn:
                return [tuple(r) for r in conn.execute(text(f"SELECT id, carrier FROM {table}"))]

        assert wait_for(shipped, what="the handler's row") == [(7, "post")]
        assert container.terminate() == 0
    with backend.container(settings) as again:  # a second start leaves the table and its rows
        assert shipped() == [(7, "post")]
        assert again.terminate() == 0
    assert "all 1 table(s) of shipping:Base exist; none created" in again.output()
    assert again.output().count("created 1 table") == 1, "the second start created nothing (one log)"


@pytest.mark.parametrize(("reference", "expected"), [
    ("shipping:nothing", "container.metadata = 'shipping:nothing': shipping has no attribute 'nothing'"),
    ("shipping:ship", "a function, not a SQLAlchemy MetaData"),
    ("no_such_models:Base", "module 'no_such_models' not found"),
])
def test_check_refuses_a_reference_that_is_not_a_metadata(tmp_path: Path, reference: str,
                                                           expected: str) -> None:
    settings = app(tmp_path, metadata=reference)
    result = mdb("check", "-c", str(settings), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    line = one_line_error(result)
    assert str(settings) in line and expected in line, line


def test_a_reference_without_an_attribute_is_a_settings_error(tmp_path: Path) -> None:
    settings = app(tmp_path, metadata="shipping")
    result = mdb("check", "-c", str(settings), cwd=tmp_path)
    assert result.returncode == 2
    assert "container.metadata: 'shipping' is not 'module:attribute'" in one_line_error(result)
