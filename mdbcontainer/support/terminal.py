"""Plain text tables that fit the terminal: one line per row, never wrapped.

A row folded over nine lines in 80 columns is unreadable, and a table a
script parses should use ``--json`` anyway. So every row stays on one line:
when the columns do not fit, the least needed ones are left out first (a
column that says ``drop``; a column of zeros before any other), a last line
names them, then the widest shrink (down to a minimum each), and a cut cell
ends in ``…``. A column a person copies from (an id) is never cut. Numbers are
right-aligned.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

GAP = "  "
ELLIPSIS = "…"


@dataclass(frozen=True)
class Column:
    """A column's header, the width below which it is not cut, and its alignment.

    ``keep``: never cut (ids to copy). ``drop``: left out when even the minimums
    do not fit, highest first, a column of zeros before all others; 0 is never
    left out.
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
    least = [n if c.keep else min(c.minimum, n) for c, n in zip(columns, natural, strict=True)]
    shown = list(range(len(columns)))

    def needed(widths: Sequence[int]) -> int:
        return sum(widths[i] for i in shown) + len(GAP) * (len(shown) - 1)

    def rank(i: int) -> int:
        zeros = bool(cells) and all(row[i] == "0" for row in cells)
        return columns[i].drop + (1000 if zeros else 0)

    while needed(least) > width and any(columns[i].drop for i in shown):
        shown.remove(max((i for i in shown if columns[i].drop), key=rank))
    widths = list(natural)
    while needed(widths) > width:
        shrinkable = [i for i in shown if widths[i] > max(least[i], 1)]
        if not shrinkable:
            break  # narrower than every minimum: the lines are cut at the edge below
        widths[max(shrinkable, key=lambda i: widths[i])] -= 1
    lines = []
    for row in [[c.header for c in columns], *cells]:
        parts = [_align(row[i], widths[i], columns[i].right) for i in shown]
        lines.append(cut(GAP.join(parts).rstrip(), width))
    left_out = [c.header for i, c in enumerate(columns) if i not in shown]
    if left_out:
        note = f"(left out to fit {width} columns: {', '.join(left_out)}; --json shows every field)"
        lines += textwrap.wrap(note, max(width, 20))
    return lines


def _align(text: str, width: int, right: bool) -> str:
    text = cut(text, width)
    return text.rjust(width) if right else text.ljust(width)
