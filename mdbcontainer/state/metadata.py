"""``[container] metadata``: the application's own tables, created at start for development.

A service in production migrates its schema with its own tool (Alembic,
against the same ``database_url``). In development, in samples and in tests,
naming the application's SQLAlchemy ``MetaData`` (or a declarative ``Base``)
lets the container create the tables that are missing before any port
starts, so that no handler has to create them on first use. ``create_all``
creates what is missing and alters nothing that exists.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, MetaData, inspect

from ..errors import ListenerError
from ..settings import Settings

KEY = "container.metadata"


def load_metadata(settings: Settings) -> MetaData | None:
    """The ``MetaData`` that ``container.metadata`` names, or None when it names none.

    The module is found as the listener modules are (the settings file's folder
    and the working directory are on the path). Every fault is one
    :class:`ListenerError` line naming the file and the key.
    """
    reference = settings.container.metadata
    if not reference:
        return None
    where = f"{settings.source}: {KEY} = {reference!r}"
    module_name, _, attribute = reference.partition(":")
    folder = Path(settings.source).parent if settings.source.endswith(".toml") else None
    value = _attribute(_module(module_name, folder, where), attribute, where)
    metadata = getattr(value, "metadata", value)  # a declarative Base carries its MetaData
    if not isinstance(metadata, MetaData):
        raise ListenerError(f"{where}: a {type(value).__name__}, not a SQLAlchemy MetaData "
                            "(name a MetaData or a declarative Base)")
    return metadata


def create_missing(metadata: MetaData, engine: Engine) -> list[str]:
    """Create the tables of ``metadata`` that are missing; the names of those it created.

    The start log says what it did: a log that claims a creation on every start
    hides the one start that really created (or failed to create) a table.
    """
    inspector = inspect(engine)
    missing = [t.name for t in metadata.sorted_tables if not inspector.has_table(t.name, schema=t.schema)]
    metadata.create_all(engine)
    return missing


def _module(name: str, folder: Path | None, where: str) -> Any:
    for entry in (str(Path.cwd()), str(folder) if folder else None):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise ListenerError(f"{where}: module {name!r} not found (is it on the path?)") from exc
        raise ListenerError(f"{where}: module {name!r} failed to import: {exc}") from exc
    except Exception as exc:
        raise ListenerError(
            f"{where}: module {name!r} failed to import: {type(exc).__name__}: {exc}"
        ) from exc


def _attribute(module: Any, path: str, where: str) -> Any:
    value = module
    for part in path.split("."):
        try:
            value = getattr(value, part)
        except AttributeError as exc:
            raise ListenerError(f"{where}: {module.__name__} has no attribute {path!r}") from exc
    return value
