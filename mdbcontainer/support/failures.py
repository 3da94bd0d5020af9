"""A failure in words: one line for a log or an error message, a bounded traceback for a header.

Every layer reports failures (a lost broker connection, a database that
refused, a handler's exception), so the wording lives once, at the bottom,
and URL passwords are masked in one place.
"""

from __future__ import annotations

import traceback

from ..settings import mask_url
from .logs import mask_secrets

MAX_TRACEBACK = 4000


def describe(exc: BaseException | None) -> str:
    """An exception as one line, with any URL password masked."""
    if exc is None:
        return "unknown error"
    orig = getattr(exc, "orig", None)  # SQLAlchemy wraps the driver's error: show the database's text
    if isinstance(orig, BaseException):
        exc = orig
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return mask_url(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def exception_text(exc: BaseException) -> str:
    """Type, message and a bounded traceback, kept across processes in ``x-mdb-exception``."""
    # Masked: the header is printed by mdb dlq show, and a handler's error may carry a URL.
    text = mask_secrets("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if len(text) > MAX_TRACEBACK:
        text = text[:200] + "\n...\n" + text[-(MAX_TRACEBACK - 210) :]
    return text.strip()
