"""MkDocs hook: the reference pages' tables, generated from the code at build time.

``<!-- mdb:settings -->`` in a page becomes a table per settings section, read
from the pydantic models (key, type, default) with each key's meaning from
``settings.yml`` beside this file (or the field's own ``description``);
``<!-- mdb:cli -->`` becomes a section per ``mdb`` command, read from the
typer app (usage, help, arguments and options); ``<!-- mdb:errors -->`` a
table of the exceptions ``mdbcontainer`` exports, with the exit code of each.
Written from the code, they cannot drift from it; a key nobody has described
fails the strict build.
"""

from __future__ import annotations

import json
import logging
import types
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

log = logging.getLogger("mkdocs.plugins.mdb_reference")

MEANINGS = Path(__file__).with_name("settings.yml")

# The sections of a settings file: (table as written, the model of its keys, what it is).
SECTIONS = (
    ("container", "ContainerSettings", "what the whole process shares"),
    ("console", "ConsoleSettings", "the operators' web page, `mdb console`"),
    ("queues", "QueueSettings", "`[queues.Q]`: properties of queue `Q`, declared by the container"),
    ("ports", "PortFields", "`[ports.P]`: listener port `P`, the consumers that feed one handler"),
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- mdb:settings -->" in markdown:
        markdown = markdown.replace("<!-- mdb:settings -->", settings_reference())
    if "<!-- mdb:cli -->" in markdown:
        markdown = markdown.replace("<!-- mdb:cli -->", cli_reference())
    if "<!-- mdb:errors -->" in markdown:
        markdown = markdown.replace("<!-- mdb:errors -->", errors_reference())
    return markdown


# -- settings ---------------------------------------------------------------------------------


def settings_reference() -> str:
    from mdbcontainer.settings import models

    meanings = yaml.safe_load(MEANINGS.read_text())
    parts = []
    for table, model_name, what in SECTIONS:
        model: type[BaseModel] = getattr(models, model_name)
        prefix = {"queues": "queues.Q.", "ports": "ports.P."}.get(table, f"{table}.")
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            meaning = field.description or meanings.get(table, {}).get(name)
            if not meaning:
                log.warning("settings reference: %s%s has no meaning in %s", prefix, name, MEANINGS.name)
                meaning = ""
            rows.append(f"| `{name}` | {type_of(field)} | {default_of(field)} | {meaning} |")
        heading = f"[{table}]" if table in {"container", "console"} else f"[{table}.NAME]"
        parts.append(f"### `{heading}`\n\n{what[0].upper() + what[1:]}.\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


def type_of(field: FieldInfo) -> str:
    words = _type_words(field.annotation)
    bounds = [(getattr(m, "ge", None), getattr(m, "le", None)) for m in field.metadata]
    low = next((lo for lo, _ in bounds if lo is not None), None)
    high = next((hi for _, hi in bounds if hi is not None), None)
    if low is not None and high is not None:
        words += f", {low} to {high}"
    elif low is not None:
        words += f", at least {low}"
    return words


def _type_words(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if annotation is timedelta:
        return "duration"
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in typing.get_args(annotation))
    if origin in (types.UnionType, typing.Union):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " or ".join(_type_words(k) for k in kinds)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return f"list of {_type_words(item)}"
    return {str: "string", int: "integer", bool: "boolean", float: "number"}.get(annotation, str(annotation))


def default_of(field: FieldInfo) -> str:
    from mdbcontainer.settings import format_duration

    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, timedelta):
        return f'`"{format_duration(value)}"`'
    return f"`{json.dumps(value)}`"


# -- the mdb command ----------------------------------------------------------------------------


def cli_reference() -> str:
    import typer.main

    from mdbcontainer.cli.main import app

    root = typer.main.get_command(app)
    context = root.context_class(root, info_name="mdb")
    return "\n\n".join(_command_sections(root, context, "mdb"))


def _command_sections(command: Any, context: Any, path: str) -> list[str]:
    subcommands = getattr(command, "commands", None)
    if subcommands is None:
        return [_command_section(command, context, path)]
    sections = []
    for name, sub in subcommands.items():
        if not sub.hidden:
            child = sub.context_class(sub, info_name=name, parent=context)
            sections += _command_sections(sub, child, f"{path} {name}")
    return sections


def _command_section(command: Any, context: Any, path: str) -> str:
    usage = " ".join(command.collect_usage_pieces(context))
    lines = [f"### `{path}`", "", " ".join((command.help or "").split()), "", "```text",
             f"{path} {usage}", "```"]
    rows = []
    for param in command.get_params(context):
        if getattr(param, "hidden", False) or param.name == "help":
            continue
        if param.param_type_name == "argument":
            name = f"`{param.metavar or str(param.name).upper()}`"
        else:
            metavar = "" if param.is_flag else f" {param.metavar or param.make_metavar(context)}"
            name = ", ".join(f"`{opt}{metavar}`" for opt in [*param.opts, *param.secondary_opts])
        rows.append(f"| {name} | {' '.join((getattr(param, 'help', None) or '').split())} |")
    if rows:
        lines += ["", "| argument or option | meaning |", "| --- | --- |", *rows]
    return "\n".join(lines)


# -- errors -------------------------------------------------------------------------------------


def errors_reference() -> str:
    import mdbcontainer
    from mdbcontainer.errors import MdbError

    rows = ["| exception | is a | `mdb` exits | raised when |", "| --- | --- | --- | --- |"]
    for name in mdbcontainer.__all__:
        value = getattr(mdbcontainer, name)
        if isinstance(value, type) and issubclass(value, MdbError):
            parent = value.__mro__[1].__name__
            summary = " ".join((value.__doc__ or "").strip().split("\n\n")[0].split())
            rows.append(f"| `{name}` | `{parent}` | {value.exit_code} | {summary} |")
    return "\n".join(rows)
