"""The passwords of the settings' URLs: hidden in every text, and URLs their clients would misread refused.

A password may hold any character once percent-encoded; written as it is, a
``/`` or an ``@`` in it is where URL parsers disagree. ``urllib`` (so kombu)
ends the host part at the first ``/`` and reads ``amqp://app:s3/cret@mq//`` as
host ``app``, port ``s3``. SQLAlchemy takes ``/`` in a password but ends it at
the first ``@``: ``postgresql://app:p@ss@db/x`` is password ``p`` on host
``ss@db``, which then shows in the driver's own "failed to resolve host"
text. So masking reads a password up to the last ``@`` of its URL, whatever
it holds, and every password the settings name is also hidden wherever else
it appears (a driver's error text); the two URLs no client would connect
with as meant are settings errors that say how to write them.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

# ``scheme://user:password@``, the password up to the last ``@`` before a blank, a quote,
# or the next URL of a list (``;amqp://`` or ``,amqp://``).
_USERINFO = re.compile(
    r"(?<=://)([^:/@\s'\"]*):((?:(?![;,][a-z][a-z0-9+.-]*://)[^\s'\"])*)@", re.IGNORECASE)
# Shorter passwords would mask ordinary words of a text.
_SHORTEST_KNOWN = 4
# Passwords of the settings loaded in this process, hidden wherever a text holds them. A
# registry, not a parameter: a log line or an error far from the settings must be masked too.
_known: set[str] = set()

ENCODE_HINT = "percent-encode it in the URL: '/' as %2F, '@' as %40, ':' as %3A"


def mask_url(text: str) -> str:
    """Hide URL passwords in ``text`` (``amqp://guest:***@host``) and every password the settings name."""
    masked = _USERINFO.sub(lambda m: f"{m.group(1)}:***@", text)
    for secret in _known:
        if secret in masked:
            masked = masked.replace(secret, "***")
    return masked


def remember_password(url: str) -> None:
    """Hide the password of ``url`` in every text this process masks from now on.

    Both spellings: as written and percent-decoded (what a driver's message shows).
    A password equal to its user name is not hidden apart (``guest:guest``
    would show as ``***:***``): the user name is shown anyway.
    """
    match = _USERINFO.search(url)
    if match is None:
        return
    user, password = match.group(1), match.group(2)
    for spelling in {password, unquote(password)}:
        if len(spelling) >= _SHORTEST_KNOWN and spelling not in (user, unquote(user)):
            _known.add(spelling)


def broker_url_problem(url: str) -> str | None:
    """Why the broker client would misread ``url`` (a ``/`` in its password), else None."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unbalanced [ of an IPv6 host
        return str(exc)
    if not parts.netloc or "@" in parts.netloc:
        return None
    head = parts.path.split("?", 1)[0]
    if "@" in head:  # the host part ended inside the user name or password
        return f"a '/' in its user name or password ends the host part early: {ENCODE_HINT}"
    return None


def database_url_problem(url: str) -> str | None:
    """Why SQLAlchemy would misread ``url`` (an ``@`` in its password), else None.

    Read as SQLAlchemy reads it (a password ends at the first ``@``), without
    importing it: ``mdb send`` loads the settings and never needs a database.
    """
    rest = url.partition("://")[2]
    userinfo, at, after = rest.partition("@")
    if not at or "/" in userinfo.partition(":")[0]:  # no user name: the @ is in a path
        return None
    host = re.split(r"[/:?]", after, maxsplit=1)[0]
    if "@" in host:
        return f"an '@' in its user name or password is read as the start of the host: {ENCODE_HINT}"
    return None
