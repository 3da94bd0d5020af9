"""The container's headers and backout reasons: spelled once, in ``wire.headers``, as the contract names them."""

from __future__ import annotations

import ast
from pathlib import Path

from mdbcontainer.wire import headers

PACKAGE = Path(__file__).resolve().parents[2] / "mdbcontainer"


def test_the_headers_of_a_backed_out_message_are_the_contracts() -> None:
    """CONTRACT.md (Headers on a backed-out message): an operator's scripts read these names."""
    assert (headers.BACKOUT_REASON, *headers.FAILURE_HEADERS) == (
        "x-mdb-backout-reason", "x-mdb-original-destination", "x-mdb-port", "x-mdb-redelivery-count",
        "x-mdb-exception", "x-mdb-failed-at")
    assert headers.REASONS == ("backout-threshold", "invalid-body", "missing-message-id")


def test_every_own_header_starts_with_the_prefix_a_replay_strips() -> None:
    own = [value for name, value in vars(headers).items()
           if name.isupper() and isinstance(value, str) and value.startswith("x-")]
    assert [v for v in own if not v.startswith(headers.PREFIX)] == [headers.BROKER_DELIVERY_COUNT]
    assert set(headers.FAILURE_HEADERS) <= headers.WAIT_HEADERS


def _literals(path: Path) -> list[str]:
    """String constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_module_but_wire_headers_spells_a_header_or_a_reason() -> None:
    """A header renamed in one module only would leave ``mdb dlq`` reading a header nobody writes."""
    spelled = {headers.PREFIX, *headers.REASONS}
    found = [f"{path.relative_to(PACKAGE)}: {text!r}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != PACKAGE / "wire" / "headers.py" and any(s in path.read_text() for s in spelled)
             for text in _literals(path) if any(s in text for s in spelled)]
    assert not found, "import these from mdbcontainer.wire.headers:\n" + "\n".join(found)
