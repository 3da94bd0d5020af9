"""Every example of the documentation (README.md and docs/), checked against the code.

Python blocks must compile, and the ones marked ``<!-- runnable -->`` (on the
line before the fence) run as scripts on the embedded broker, in a scratch
folder holding a copy of the tour's ``settings.example.toml`` and ``listeners/``.
TOML blocks load through the settings models: an unknown key or a bad value
fails, and a port with its queue or topic is validated as ``mdb run`` binds it.
Console blocks must parse as the typer app parses ``mdb`` (commands, options,
arguments and their values), and may name only ``make`` targets the Makefile has.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer import Exit

try:  # recent typer vendors click (as mdbcontainer/cli/main.py says)
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException  # type: ignore[import-not-found,no-redef,assignment,unused-ignore]

from mdbcontainer.errors import SettingsError
from mdbcontainer.settings import settings_from_dict, validate_port
from tests.conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)")
RUNNABLE = "<!-- runnable -->"
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.MULTILINE)  # pymdownx.snippets: a file of the repo


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language, its text."""

    page: Path
    line: int
    lang: str
    text: str
    runnable: bool

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page (fences may be indented, inside a list)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        match = FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        indent, start = len(match["indent"]), index
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        body = textwrap.dedent("\n".join(line[indent:] for line in lines[start + 1:end]))
        body = SNIPPET.sub(lambda m: (ROOT / m["path"]).read_text(encoding="utf-8").rstrip("\n"), body)
        before = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        found.append(Block(page, start + 1, match["lang"], body + "\n", before == RUNNABLE))
        index = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def of(lang: str, runnable: bool | None = None) -> Any:
    chosen = [b for b in BLOCKS if b.lang == lang and (runnable is None or b.runnable == runnable)]
    return pytest.mark.parametrize("block", chosen, ids=[b.where for b in chosen])


# -- Python ---------------------------------------------------------------------------------------


@of("python")
def test_python_blocks_compile(block: Block) -> None:
    compile(block.text, block.where, "exec")


@pytest.mark.slow
@pytest.mark.timeout(300)  # an example that starts `mdb run` on a machine loaded by the other tests
@of("python", runnable=True)
def test_runnable_python_blocks_run_on_the_embedded_broker(block: Block, tmp_path: Path) -> None:
    shutil.copy(ROOT / "settings.example.toml", tmp_path / "settings.example.toml")
    shutil.copytree(ROOT / "listeners", tmp_path / "listeners", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "example.py"
    script.write_text(block.text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDB_")}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_the_docs_have_runnable_examples() -> None:
    assert len([b for b in BLOCKS if b.runnable]) >= 2, "the tour and the sending guide run as they are"
    assert all(b.lang == "python" for b in BLOCKS if b.runnable), "only Python blocks run"


# -- TOML -----------------------------------------------------------------------------------------


def load_toml_example(text: str, where: str) -> None:
    """Load a TOML example as ``mdb`` loads a file; a port that names its queue binds too."""
    data = tomllib.loads(text)
    settings_from_dict(data, source=where)
    for name, table in data.get("ports", {}).items():
        if "destination" in table or "topic" in table:
            validate_port(where, name, table)


@of("toml")
def test_toml_blocks_load_through_the_settings_models(block: Block) -> None:
    load_toml_example(block.text, block.where)


@pytest.mark.parametrize("text, culprit", [
    ('[ports.OrdersPort]\ndestination = "ORDERS"\nmax_retrys = 5\n', "max_retrys"),
    ('[container]\nheartbeat = "soon"\n', "heartbeat"),
    ('[ports.OrdersPort]\ndestination = "ORDERS"\ntopic = "orders.events"\n', "exactly one"),
])
def test_a_bad_toml_example_fails(text: str, culprit: str) -> None:
    with pytest.raises(SettingsError, match=culprit):
        load_toml_example(text, "docs/bad.md:1")


# -- console ---------------------------------------------------------------------------------------


def commands_of(text: str) -> list[list[str]]:
    """The commands typed in a console block: ``$ `` lines, their ``\\`` continuations, split at
    ``&&``, ``;`` and ``|``, with leading ``VAR=value`` assignments dropped."""
    typed, current = [], None
    for line in text.splitlines():
        if current is None and not line.startswith("$ "):
            continue
        part = line[2:] if current is None else line
        current = (current or "") + part.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            typed.append(current)
            current = None
    commands = []
    for command in typed:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
        lexer.commenters = "#"
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in {";", "&&", "|", "||", "&"}:
                while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                    words.pop(0)
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def mdb_problem(words: list[str]) -> str | None:
    """What ``mdb WORDS...`` would be refused for (an unknown command or option, a missing
    argument, a bad value), parsed by the typer app as ``mdb`` parses it; None when it parses."""
    import typer.main

    from mdbcontainer.cli.main import app

    command: Any = typer.main.get_command(app)
    name, args, parent = "mdb", list(words), None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # -h and --version print, then exit 0
            while True:
                context = command.make_context(name, args, parent=parent)
                if getattr(command, "commands", None) is None:
                    return None
                rest = [*getattr(context, "_protected_args", []), *context.args]
                if not rest:
                    return f"{context.command_path}: no command given"
                name, command, args = command.resolve_command(context, rest)
                parent = context
    except ClickException as exc:
        path = exc.ctx.command_path if getattr(exc, "ctx", None) else "mdb"
        return f"{path}: {exc.format_message()}"
    except Exit:
        return None


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def console_problems(text: str) -> list[str]:
    problems = []
    for words in commands_of(text):
        program = os.path.basename(words[0])
        if program == "mdb":
            problem = mdb_problem(words[1:])
            if problem:
                problems.append(f"{shlex.join(words)}: {problem}")
        elif program == "make" and len(words) > 1 and words[1] not in make_targets():
            problems.append(f"{shlex.join(words)}: the Makefile has no target {words[1]!r}")
    return problems


@of("console")
def test_console_blocks_name_commands_and_options_that_exist(block: Block) -> None:
    assert console_problems(block.text) == [], block.where


@pytest.mark.parametrize("text", [
    "$ mdb --version\n", "$ mdb dlq list -h\n", "$ mdb send ORDERS @orders.jsonl --lines -c s.toml\n",
    "$ mdb run --port OrdersPort --processes 4   # a comment\n",
])
def test_a_console_example_that_parses_passes(text: str) -> None:
    assert console_problems(text) == []


def test_the_docs_type_mdb_commands() -> None:
    typed = [words for b in BLOCKS if b.lang == "console" for words in commands_of(b.text)]
    assert len([w for w in typed if os.path.basename(w[0]) == "mdb"]) >= 10


@pytest.mark.parametrize("text, problem", [
    ("$ mdb sned ORDERS '{}'\n", "No such command 'sned'"),
    ("$ mdb dlq list --queu Q\n", "mdb dlq list: No such option: --queu"),
    ("$ MDB_X=1 .venv/bin/mdb port start --jsn OrdersPort\n", "No such option: --jsn"),
    ("$ cd /tmp && mdb check \\\n  --bogus\n", "mdb check: No such option: --bogus"),
    ("$ mdb port start\n", "mdb port start: Missing argument 'NAME'"),
    ("$ mdb run --processes 0\n", "Invalid value for '--processes'"),
    ("$ make docz\n", "no target 'docz'"),
])
def test_a_console_example_naming_what_does_not_exist_fails(text: str, problem: str) -> None:
    (found,) = console_problems(text)
    assert problem in found


# -- the README -----------------------------------------------------------------------------------


def test_the_readme_is_short_and_its_links_reach_the_site() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200, "the README is the tour and the way in; the rest is docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert len([link for link in links if link.startswith("docs/")]) >= 20
    assert [link for link in links if not link.startswith("http") and not (ROOT / link).exists()] == []
