"""Plain text tables that fit the terminal without cutting what a person reads.

A row folded by the terminal over nine lines is unreadable, and a cell cut to
``sta…`` says nothing. So when the columns do not fit the width:

1. columns that are empty in every row (``-`` or nothing) are left out: they
   tell nothing;
2. then, least needed first (a column that says ``drop``; a column of zeros
   before any other), columns move off the row's line onto an indented second
   line, as ``header: value`` pairs wrapped at the width, so nothing is cut;
3. the identifying columns (``keep``: the names that tell rows apart, ids a
   person copies) never move and are never cut.

Only when the identifying columns alone are wider than the terminal are the
other cells of the first line shrunk (down to their minimum) and the line cut
at the edge. Numbers are right-aligned. A table a script parses should use
``--json`` anyway.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

GAP = "  "
ELLIPSIS = "…"
INDENT = "    "
EMPTY = ("", "-")


@dataclass(frozen=True)
class Column:
    """A column's header, the width below which it is not cut, its alignment, and its rank.

    ``keep``: identifying (a name that tells rows apart, an id to copy): stays
    on the row's line, whole. ``drop``: how early the column moves to the second
    line when the row does not fit (highest first; a column of zeros before all
    others; 0 last).
    """

    header: str
    minimum: int = 6
    right: bool = False
    keep: bool = False
    drop: int = 0


def terminal_width() -> int:
    """``$COLUMNS``, else the terminal's width, else 80 (output to a pipe or a file)."""
    return shutil.get_terminal_size((80, 24)).columns


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, ending in ``…`` when cut."""
    if len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS if width > 0 else ""


def fit(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None = None) -> list[str]:
    """The header and the rows as lines of at most ``width`` characters (default: the terminal's)."""
    width = terminal_width() if width is None else width
    cells = [[" ".join(str(cell).split()) for cell in row] for row in rows]  # one line per cell
    natural = [max([len(c.header), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    shown = _first_line(columns, cells, natural, width)
    moved = [i for i in range(len(columns)) if i not in shown and not _empty(cells, i)]
    widths = _shrunk(columns, natural, shown, width)
    lines = [_line([c.header for c in columns], columns, shown, widths, width)]
    for row in cells:
        lines.append(_line(row, columns, shown, widths, width))
        lines += _second_line(row, columns, moved, width)
    return lines


def _empty(cells: Sequence[Sequence[str]], i: int) -> bool:
    return bool(cells) and all(row[i] in EMPTY for row in cells)


def _needed(widths: Sequence[int], shown: Sequence[int]) -> int:
    return sum(widths[i] for i in shown) + len(GAP) * (len(shown) - 1)


def _first_line(columns: Sequence[Column], cells: Sequence[Sequence[str]], natural: Sequence[int],
                width: int) -> list[int]:
    """The columns that stay on the row's line: empty ones out, then the least needed moved off."""
    shown = list(range(len(columns)))
    if _needed(natural, shown) <= width:
        return shown
    shown = [i for i in shown if columns[i].keep or not _empty(cells, i)]

    def rank(i: int) -> tuple[int, int]:
        zeros = bool(cells) and all(row[i] == "0" for row in cells)
        return columns[i].drop + (1000 if zeros else 0), natural[i]

    moved = []
    while _needed(natural, shown) > width:
        movable = [i for i in shown if not columns[i].keep]
        if not movable:
            break
        moved.append(max(movable, key=rank))
        shown.remove(moved[-1])
    for i in reversed(moved[:-1]):  # a column moved early may fit beside what the last move freed
        if _needed(natural, [*shown, i]) <= width:
            shown = sorted([*shown, i])
    return shown


def _shrunk(columns: Sequence[Column], natural: Sequence[int], shown: Sequence[int], width: int) -> list[int]:
    """The widths of the first line; cells shrink only when the identifying columns overflow."""
    least = [n if c.keep else min(c.minimum, n) for c, n in zip(columns, natural, strict=True)]
    widths = list(natural)
    while _needed(widths, shown) > width:
        shrinkable = [i for i in shown if widths[i] > max(least[i], 1)]
        if not shrinkable:
            break  # narrower than every minimum: the lines are cut at the edge
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    return widths


def _line(row: Sequence[str], columns: Sequence[Column], shown: Sequence[int], widths: Sequence[int],
          width: int) -> str:
    parts = [_align(row[i], widths[i], columns[i].right) for i in shown]
    return cut(GAP.join(parts).rstrip(), width)


def _second_line(row: Sequence[str], columns: Sequence[Column], moved: Sequence[int],
                 width: int) -> list[str]:
    """The moved cells of one row, ``header: value``, wrapped (never cut) under the row."""
    lines: list[str] = []
    width = max(width, 20)
    for pair in (f"{columns[i].header}: {row[i]}" for i in moved if row[i] not in EMPTY):
        if lines and len(lines[-1]) + len(GAP) + len(pair) <= width:
            lines[-1] += GAP + pair  # pairs side by side while they fit, a pair split only when long
        else:
            lines += textwrap.wrap(pair, width, initial_indent=INDENT, subsequent_indent=INDENT * 2,
                                   break_on_hyphens=False)
    return lines


def _align(text: str, width: int, right: bool) -> str:
    text = cut(text, width)
    return text.rjust(width) if right else text.ljust(width)
