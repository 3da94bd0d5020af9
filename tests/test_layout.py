"""The test tree's own layout: in-process tests mirror the package's folders, and helpers live apart.

A test module that imports another test module runs that module's tests'
imports (and its fixtures' names) for nothing and breaks when it is renamed:
shared helpers live in a ``conftest.py``, ``tests/inprocess.py``,
``tests/apps/`` or ``tests/chaos/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# Folders of tests that are no package folder: what a user sees, and the fixtures' own code.
NOT_MIRRORS = {"behaviour", "apps", "chaos", "record", "docs", "__pycache__"}  # suites that are not one module's tests


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_no_test_module_imports_another_test_module() -> None:
    offenders = [f"{path.relative_to(ROOT)} imports {module}" for path in sorted(TESTS.rglob("*.py"))
                 for module in sorted(_imported(path))
                 if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")]
    assert not offenders, "move the shared helper into a conftest.py:\n" + "\n".join(offenders)


def test_each_folder_of_fast_tests_mirrors_a_folder_of_the_package() -> None:
    folders = {d.name for d in TESTS.iterdir() if d.is_dir()} - NOT_MIRRORS
    package = {d.name for d in (ROOT / "mdbcontainer").iterdir() if (d / "__init__.py").is_file()}
    assert folders <= package, f"tests/ folders without a package folder: {sorted(folders - package)}"
    assert {"wire", "state", "operations", "pipeline", "units"} <= folders


def test_no_test_reloads_a_module_of_the_package() -> None:
    """A reload makes new classes: ``except Killed`` in a module that imported the old
    ``support.crash.Killed`` no longer caught the kit's, and a crash escaped its consumer thread
    in every later in-process crash test of that pytest worker."""
    offenders = [str(path.relative_to(ROOT)) for path in sorted(TESTS.rglob("*.py"))
                 if path != Path(__file__).resolve()
                 and any(isinstance(node, ast.Attribute) and node.attr == "reload"
                         for node in ast.walk(ast.parse(path.read_text())))]
    assert not offenders, "call the module's own re-read (crash.read_environment()):\n" + "\n".join(offenders)
