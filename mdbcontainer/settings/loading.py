"""Loading settings: the TOML file, its ``MDB_...`` environment overrides, and errors in one line.

Every error names the file (or the environment variable that set the key) and
the key path, with a suggestion for a misspelt key. Relative paths in the file
are resolved against its folder.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import SettingsError
from .models import (
    EMBEDDED_DEFAULT_FILE,
    EMBEDDED_SCHEME,
    ContainerSettings,
    Overrides,
    PortSettings,
    Settings,
)

ENV_PREFIX = "MDB_"
# Environment variables that configure the tool itself rather than a key of the file.
_RESERVED_ENV = {"MDB_SETTINGS", "MDB_REQUIRE_SERVICES", "MDB_CRASH_AT", "MDB_CRASH_ONCE_FILE"}


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise SettingsError(f"{path}: settings file not found") from exc
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: invalid TOML: {exc}") from exc


def _env_value(raw: str) -> Any:
    """An override is read as TOML/JSON when it parses (numbers, booleans, lists), else as text."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _match_key(table: dict[str, Any], key: str, *, is_name: bool = False) -> str:
    """The table's own spelling of ``key``; a new key is a field (lowercase) or a name (as given)."""
    for existing in table:
        if existing.lower() == key.lower():
            return existing
    return key if is_name else key.lower()


def apply_env(
    data: dict[str, Any], environ: dict[str, str], overrides: Overrides | None = None
) -> dict[str, Any]:
    """Lay ``MDB_A__B__C=value`` overrides over the file's data, matching names case-insensitively.

    ``overrides`` (when given) learns which variable set which key path, so that
    an error in that value names the variable rather than the file.
    """
    for name, raw in sorted(environ.items()):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in _RESERVED_ENV:
            continue
        path = [part for part in name[len(ENV_PREFIX) :].split("__") if part]
        if len(path) < 2:
            continue
        table = data
        keys: list[str] = []
        for depth, part in enumerate(path[:-1]):
            named = depth == 1 and path[0].lower() in {"queues", "topics", "ports"}
            keys.append(_match_key(table, part, is_name=named))
            table = table.setdefault(keys[-1], {})
            if not isinstance(table, dict):
                raise SettingsError(f"{name}: {'.'.join(path)} overrides a value that is not a table")
        keys.append(_match_key(table, path[-1]))
        table[keys[-1]] = _env_value(raw)
        if overrides is not None:
            overrides[tuple(keys)] = name
    return data


def culprit(source: str, loc: tuple[str, ...], overrides: Overrides | None) -> str:
    """Who set the key at ``loc``: the environment variable that overrode it, else the file.

    A fault in a whole table (a contradictory combination) names the file and
    the variables that changed that table.
    """
    within = []
    for path, variable in (overrides or {}).items():
        if loc[: len(path)] == path:
            return f"environment variable {variable}"
        if loc and path[: len(loc)] == loc:
            within.append(variable)
    return f"{source} with {', '.join(sorted(within))}" if within else source


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: Any = Settings
    for part in loc[:-1]:
        fields = getattr(model, "model_fields", None)
        if fields is None:
            continue
        if part in fields:
            annotation = fields[part].annotation
            model = _model_of(annotation)
    fields = getattr(model, "model_fields", {})
    return [name for name in fields if name != "source"]


def _model_of(annotation: Any) -> Any:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
        for inner in getattr(candidate, "__args__", ()):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
    return annotation


def describe_error(source: str, exc: ValidationError, overrides: Overrides | None = None,
                   prefix: tuple[str, ...] = ()) -> str:
    """One line naming the file (or variable), the key path and what is wrong, with a suggestion."""
    parts: list[str] = []
    first: tuple[str, ...] = prefix
    for error in exc.errors():
        loc = tuple(str(p) for p in error["loc"] if not str(p).startswith("function-"))
        loc = prefix + tuple(p for p in loc if p not in {"PortSettings", "PortFields", "dict[str,any]"})
        where = ".".join(loc) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        key, _, rest = message.partition(": ")
        if loc == prefix and rest and key in PortSettings.model_fields:  # a rule about one key names it
            loc, message = (*loc, key), rest
            where = ".".join(loc)
        if error["type"] == "extra_forbidden":
            message = f"unknown key '{loc[-1]}'"
            close = difflib.get_close_matches(loc[-1], _known_keys(loc[len(prefix):]), n=1)
            if close:
                message += f". Did you mean '{close[0]}'?"
        if not parts:
            first = loc
        parts.append(f"{where}: {message}")
    more = f" (and {len(parts) - 1} more)" if len(parts) > 1 else ""
    return f"{culprit(source, first, overrides)}: {parts[0]}{more}"


def validate_port(source: str, name: str, data: dict[str, Any],
                  overrides: Overrides | None = None) -> PortSettings:
    """Validate one port's merged settings, with errors naming ``ports.NAME``."""
    try:
        return PortSettings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(describe_error(source, exc, overrides, ("ports", name))) from exc


def settings_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``-c FILE``, else ``$MDB_SETTINGS``, else ``./settings.toml``."""
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("MDB_SETTINGS") or "settings.toml")


def load_settings(
    path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None
) -> Settings:
    """Read the settings file and the environment; raise SettingsError with one line on any fault.

    Relative paths (the embedded broker's file, an SQLite database, TLS files)
    are resolved against the settings file's folder, as listener modules are,
    so every ``mdb`` command finds the same broker and database from any
    working directory.
    """
    file = settings_path(path)
    overrides: Overrides = {}
    data = apply_env(_load_toml(file), dict(os.environ if environ is None else environ), overrides)
    settings = settings_from_dict(data, source=str(file), overrides=overrides)
    container = resolve_paths(settings.container, Path(os.path.abspath(file)).parent)
    return settings.model_copy(update={"container": container})



def resolve_paths(container: ContainerSettings, folder: Path) -> ContainerSettings:
    """``container`` with every relative path made absolute against ``folder``."""
    update: dict[str, Any] = {
        "broker_url": _resolve_broker_url(container.broker_url, folder),
        "database_url": _resolve_database_url(container.database_url, folder),
    }
    for key in ("ssl_ca", "ssl_cert", "ssl_key"):
        value = getattr(container, key)
        if value:
            update[key] = str(folder / Path(value).expanduser())
    return container.model_copy(update=update)


def _resolve_broker_url(url: str, folder: Path) -> str:
    if not url.startswith(EMBEDDED_SCHEME):
        return url
    file = Path(url[len(EMBEDDED_SCHEME):] or EMBEDDED_DEFAULT_FILE).expanduser()
    return EMBEDDED_SCHEME + str(folder / file)


def _resolve_database_url(url: str, folder: Path) -> str:
    """An SQLite file URL made absolute; any other URL as it is (an invalid one fails at connect).

    Read by hand, not with SQLAlchemy's ``make_url``: importing SQLAlchemy costs
    a command that never touches the database (``mdb send``) most of its time.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+")[0] != "sqlite" or not rest.startswith("/"):
        return url  # not an SQLite file (an SQLite URL names no host: sqlite:///FILE)
    database, mark, query = rest[1:].partition("?")
    if not database or database == ":memory:" or database.startswith("file:"):
        return url
    if Path(database).expanduser().is_absolute():
        return url
    return f"{scheme}:///{folder / database}{mark}{query}"


def settings_from_dict(data: dict[str, Any], source: str = "<settings>",
                       overrides: Overrides | None = None) -> Settings:
    """Validate settings given as a dict (tests and embedding applications)."""
    try:
        # Ports are validated twice: here without decorator defaults to catch
        # unknown keys and types early, and again at bind time merged with them.
        _check_port_keys(source, data.get("ports", {}), overrides)
        for key in ("source", "overrides"):  # the loader's own fields, never the file's
            if key in data:
                raise SettingsError(f"{culprit(source, (key,), overrides)}: {key}: unknown key '{key}'")
        return Settings(**data, source=source, overrides=overrides or {})
    except ValidationError as exc:
        raise SettingsError(describe_error(source, exc, overrides)) from exc


def _check_port_keys(source: str, ports: Any, overrides: Overrides | None = None) -> None:
    if not isinstance(ports, dict):
        raise SettingsError(f"{source}: ports: must be a table of [ports.NAME] tables")
    for name, table in ports.items():
        if not isinstance(table, dict):
            who = culprit(source, ("ports", name), overrides)
            raise SettingsError(f"{who}: ports.{name}: must be a table")
        fields = PortSettings.model_fields
        for key in table:
            if key not in fields:
                close = difflib.get_close_matches(key, list(fields), n=1)
                hint = f". Did you mean '{close[0]}'?" if close else ""
                who = culprit(source, ("ports", name, key), overrides)
                raise SettingsError(f"{who}: ports.{name}.{key}: unknown key '{key}'{hint}")
        try:
            probe = {"destination": "x"} if "destination" not in table and "topic" not in table else {}
            PortSettings.model_validate({**probe, **table})
        except ValidationError as exc:
            errors = [e for e in exc.errors() if e["type"] != "value_error"]
            if errors:
                first = ValidationError.from_exception_data(exc.title, errors)  # type: ignore[arg-type]
                raise SettingsError(describe_error(source, first, overrides, ("ports", name))) from exc

