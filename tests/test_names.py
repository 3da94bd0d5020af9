"""The names docs/architecture.md and the package's docstrings cite exist in the code.

Prose drifts where no test reads it: a method renamed leaves the page naming
a thing that is gone, and the next reader searches for it in vain. So every
dotted name on the page is resolved as Python resolves it: the first part is
a module or folder of ``mdbcontainer`` (``pipeline.backout.Backout.move``),
the package itself (``mdbcontainer.testing``), a class of the package named
alone (``Pipeline._first``: it must be defined once), or one of the few names
of other libraries the page means (``typing.Protocol``, ``loop.add_reader``);
the rest is read with ``getattr``. Every file the page or a docstring names
(``runtime/port.py``, ``counts.py``) must exist.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mdbcontainer"
DOC = ROOT / "docs" / "architecture.md"

# What a short name on the page stands for, when it is not a module of the package.
SHORT_NAMES: dict[str, Any] = {
    "loop": asyncio.AbstractEventLoop,  # the consumer's event loop
    "ctx": "mdbcontainer.units.context.MessageContext",  # a handler's context
    "AsyncSession": "sqlalchemy.ext.asyncio.AsyncSession",
    "capabilities": "mdbcontainer.wire.transport.Capabilities",  # a transport's
    "kombu": importlib.import_module("kombu"),  # the transports' own connections
}
# Dotted words of the page that are no Python names, each with what it is.
NOT_PYTHON = {
    "mdb.outcome": "a span attribute",
    "error.type": "a span attribute",
    "basic.ack": "an AMQP method",
    "Q.wait": "a wait queue's name (Q.wait.2s)",
    "delivery_info.redelivered": "a key of a kombu message's delivery_info",
}

_FILE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.(?:py|md|toml))\b")
_DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.(?:[A-Za-z_]\w*|\{[\w,]+\}))+)")


def _expanded(name: str) -> list[str]:
    """``units.single.{UnitOfWork,BeanManaged}`` -> both names; anything else as it is."""
    match = re.search(r"\{([\w,]+)\}", name)
    if not match:
        return [name]
    return [n for part in match.group(1).split(",")
            for n in _expanded(name[:match.start()] + part + name[match.end():])]


def names_on(text: str) -> list[str]:
    """The dotted names of a page, file names left out (they are checked as files)."""
    text = _FILE.sub(" ", text)
    return sorted({n for m in _DOTTED.findall(text) for n in _expanded(m)} - set(NOT_PYTHON))


@cache
def _classes() -> dict[str, list[str]]:
    """Class name -> the modules of the package that define it (read from the source, not imported)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _module_or_none(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            return None
        raise


def _start(first: str) -> Any:
    """What the first part of a dotted name is, or None."""
    if first in SHORT_NAMES:
        target = SHORT_NAMES[first]
        if not isinstance(target, str):
            return target
        module, _, attr = target.rpartition(".")
        return getattr(importlib.import_module(module), attr)
    if first == "mdbcontainer":
        return importlib.import_module(first)
    if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file():
        return importlib.import_module(f"mdbcontainer.{first}")
    if first[:1].isupper():
        modules = _classes().get(first, [])
        assert len(modules) <= 1, f"{first} is defined in {modules}: name its module"
        return getattr(importlib.import_module(modules[0]), first) if modules else None
    return _module_or_none(first) if first in ("sys", "typing") else None


def resolve(name: str) -> Any:
    """The object a dotted name of the page names; AssertionError saying which part is missing."""
    first, *rest = name.split(".")
    obj = _start(first)
    assert obj is not None, f"{name}: {first!r} is no module of mdbcontainer nor a class of it"
    done = first
    for part in rest:
        module = getattr(obj, "__name__", None) if isinstance(obj, type(importlib)) else None
        child = _module_or_none(f"{module}.{part}") if module and not hasattr(obj, part) else None
        obj = child if child is not None else getattr(obj, part, _annotation(obj, part))
        assert obj is not None, f"{name}: {done} has no {part!r}"
        done += "." + part
    return obj


def _annotation(obj: Any, part: str) -> Any:
    """A dataclass field or Protocol member declared without a default is an annotation only."""
    for klass in getattr(obj, "__mro__", ()):
        if part in getattr(klass, "__annotations__", {}):
            return klass.__annotations__[part]
    return None


@pytest.mark.parametrize("name", names_on(DOC.read_text()))
def test_every_dotted_name_of_the_architecture_page_is_in_the_code(name: str) -> None:
    resolve(name)


def test_the_name_check_finds_the_names_and_refuses_what_is_gone() -> None:
    """The check itself: it reads the page's forms, and a name that is gone fails it."""
    page = ("`units.single.{UnitOfWork,BeanManaged}` and runtime/port.py: acks.requeue, "
            "`Pipeline._first`, 0.2 s")
    assert names_on(page) == ["Pipeline._first", "acks.requeue", "units.single.BeanManaged",
                              "units.single.UnitOfWork"]
    for gone in ("pipeline.backout.copy_of", "acks.requeue", "pipeline.batch.BatchPortView",
                 "ListenerPort.record", "wire.nothing"):
        with pytest.raises(AssertionError):
            resolve(gone)


def _cited_files(text: str, suffixes: tuple[str, ...] = (".py", ".md", ".toml")) -> set[str]:
    return {f for f in _FILE.findall(text) if f.endswith(suffixes)}


def _exists(cited: str, near: Path) -> bool:
    """A file a text names: a path from the repository or the package, or a file of the package."""
    if "/" in cited:
        return any((base / cited).is_file() for base in (ROOT, PACKAGE, near))
    return (near / cited).is_file() or any(PACKAGE.rglob(cited)) or (ROOT / cited).is_file()


# Files the page names that are not meant to exist: its examples of what a maintainer adds.
EXAMPLE_FILES = {"wire/nats.py"}  # "How to add a transport": the fourth one


def test_every_file_the_architecture_page_names_exists() -> None:
    missing = sorted(f for f in _cited_files(DOC.read_text()) - EXAMPLE_FILES
                     if not _exists(f, DOC.parent) and not any((ROOT / "tests").rglob(f)))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_file_a_docstring_or_comment_of_the_package_names_exists() -> None:
    """A module cited by its file name (``counts.py``, ``units/batch.py``); a user's ``settings.toml`` is no module."""
    missing = [f"{path.relative_to(ROOT)}: {cited}" for path in sorted(PACKAGE.rglob("*.py"))
               for cited in sorted(_cited_files(path.read_text(), (".py",))) if not _exists(cited, path.parent)]
    assert not missing, "\n".join(missing)
