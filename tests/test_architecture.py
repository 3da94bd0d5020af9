"""The layering of docs/architecture.md holds in the code: the table there is read and checked.

A module's layer is its folder: the table names the package's folders (``wire/``)
and the few modules lying directly in ``mdbcontainer/`` (``errors``), each once,
and every module inside a folder takes that folder's layer. Only ``wire/`` and
``embedded/`` import kombu or amqp.

Every import counts (module level, inside functions, under TYPE_CHECKING): a
type-only import of a higher layer is still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mdbcontainer.testing import write_settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mdbcontainer"
DOC = ROOT / "docs" / "architecture.md"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{target}.{a.name}" for a in node.names] + [target]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            if target in modules:
                found.add(target)
                break
    found.discard(name)
    # A subpackage's modules reach each other through their package: not an edge upward.
    return {m for m in found if not name.startswith(m + ".")}


def _graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules) for f in files}


def _layers() -> dict[str, int]:
    """folder or root module -> layer number, from the table in docs/architecture.md."""
    layers: dict[str, int] = {}
    for line in DOC.read_text().splitlines():
        match = re.match(r"\|\s*(\d+) [^|]*\|([^|]*)\|", line)
        if match:
            for name in re.findall(r"`([a-z_]+/?)`", match.group(2)):
                assert name not in layers, f"{name} is in two rows of the layer table"
                layers[name] = int(match.group(1))
    return layers


def _tree() -> set[str]:
    """The package's folders (``wire/``) and the modules lying directly in it (``errors``)."""
    folders = {f"{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    modules = {f.stem for f in PACKAGE.glob("*.py") if f.name != "__init__.py"}
    return folders | modules


def _layer_of(module: str, layers: dict[str, int]) -> int | None:
    """A module's layer is the layer of its folder (or its own row, directly in the package)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    return layers.get(f"{parts[0]}/" if len(parts) > 1 or f"{parts[0]}/" in layers else parts[0])


def test_the_layer_table_names_exactly_the_folders_and_the_root_modules() -> None:
    table, tree = set(_layers()), _tree()
    assert not tree - table, f"add these to the table of docs/architecture.md: {sorted(tree - table)}"
    assert not table - tree, f"the table of docs/architecture.md names what is gone: {sorted(table - tree)}"


def test_every_module_has_a_layer_in_the_architecture_doc() -> None:
    layers = _layers()
    missing = [m for m in _graph() if m != "mdbcontainer" and _layer_of(m, layers) is None]
    assert not missing, f"add these modules to the table of docs/architecture.md: {missing}"


def test_imports_point_down_the_layers() -> None:
    layers = _layers()
    upward = []
    for module, targets in _graph().items():
        if module == "mdbcontainer":
            continue  # the public API re-exports from every layer
        mine = _layer_of(module, layers)
        for target in targets:
            theirs = _layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            raise AssertionError("import circle: " + " -> ".join(circle))


def test_only_the_seam_and_the_acknowledgment_modes_settle_a_message() -> None:
    settling = re.compile(r"\.(ack|reject|requeue)\(")
    modules = sorted(_module(f) for f in PACKAGE.rglob("*.py")
                     if "embedded" not in f.parts and settling.search(f.read_text()))
    # wire.sqs settles through its channel's basic_ack/_settle: the transport's side of the seam.
    assert modules == ["mdbcontainer.pipeline.acknowledge", "mdbcontainer.wire.delivery"]


def test_only_the_wire_and_the_embedded_transport_touch_kombu() -> None:
    """kombu and amqp stay behind the seam; the embedded broker's file is read only through it."""
    kombu = re.compile(r"^\s*(from|import)\s+(kombu|amqp)\b", re.M)
    seam = {"mdbcontainer.wire", "mdbcontainer.embedded"}
    graph = _graph()
    outside = [m for m in graph if m.split(".")[:2] and ".".join(m.split(".")[:2]) not in seam]
    importers = [m for m in outside if kombu.search(_path(m).read_text())]
    assert not importers, f"only wire/ and embedded/ may import kombu or amqp: {importers}"
    readers = [m for m in outside if m != "mdbcontainer"
               and any(t == "mdbcontainer.embedded" or t.startswith("mdbcontainer.embedded.") for t in graph[m])]
    assert not readers, f"only wire/ may reach the embedded transport: {readers}"


def _path(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_operations_return_data_and_only_the_cli_prints() -> None:
    """``operations/`` is shared by ``mdb`` and the console: what it prints would be lost on the web page."""
    printing = re.compile(r"^\s*(from|import)\s+(typer|rich|click)\b|\bprint\(", re.M)
    modules = sorted(_module(f) for f in (PACKAGE / "operations").rglob("*.py")
                     if printing.search(f.read_text()))
    assert modules == []


# What each command may not import: ``mdb`` is run in scripts and loops, and each
# of these is a tenth of a second or more of every call (the runtime, the
# pipelines, the ORM, the web console; for ``mdb send``, SQLAlchemy at all).
SLOW_FOR_THE_CLI = ("mdbcontainer.runtime", "mdbcontainer.pipeline", "mdbcontainer.console",
                    "sqlalchemy.orm", "prometheus_client")


@pytest.mark.parametrize(("args", "forbidden"), [
    (["send", "Q", '{"n": 1}'], (*SLOW_FOR_THE_CLI, "sqlalchemy", "mdbcontainer.state")),
    (["port", "stop", "Work"], SLOW_FOR_THE_CLI),
    (["ports", "--json"], (*SLOW_FOR_THE_CLI, "mdbcontainer.handlers")),
])
def test_a_cli_command_imports_only_what_it_needs(tmp_path: Path, args: list[str],
                                                  forbidden: tuple[str, ...]) -> None:
    settings = write_settings(tmp_path / "settings.toml", {
        "container": {"broker_url": f"embedded://{tmp_path / 'broker.db'}",
                      "database_url": f"sqlite:///{tmp_path / 'container.db'}",
                      "listeners": ["tests.apps.work"]},
        "queues": {"Q": {}}, "ports": {"Work": {"destination": "Q"}},
    })
    listing = tmp_path / "modules.json"
    code = ("import atexit, json, sys\n"
            f"atexit.register(lambda: open({str(listing)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
            "from mdbcontainer.cli.main import main\n"
            f"sys.argv = ['mdb', *{[*args, '-c', str(settings)]!r}]\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    imported = json.loads(listing.read_text())
    slow = [m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not slow, f"mdb {' '.join(args)} imported {slow}"
