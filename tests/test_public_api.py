"""The public API a user imports: ``mdbcontainer.__all__``, its one exception tree, ``mdbcontainer.testing``.

Everything else of the package is internal and may move between releases
(docs/architecture.md: Public API and internals); these names change only
with a note in the README, so a test pins them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def test_public_api_is_pinned() -> None:
    import mdbcontainer

    assert sorted(mdbcontainer.__all__) == sorted([
        "BatchContext", "BrokerError", "BrokerUnavailable", "DatabaseError", "DlqError", "ListenerError", "MdbError", "Message",
        "MessageContext", "NoReplyTo", "Outbox", "Producer", "PublishError", "QueueUnavailable",
        "RequestTimeout", "Settings", "SettingsError", "SubscriptionInUse", "TransactionError",
        "Unroutable", "load_settings", "message_driven",
    ])


def test_the_testing_helpers_the_samples_use_are_there() -> None:
    """``mdbcontainer.testing`` is public: the samples and the listener projects' tests import it."""
    import mdbcontainer.testing

    for name in ("ContainerProcess", "QueueProbe", "mdb", "wait_for", "write_settings", "headers_of"):
        assert callable(getattr(mdbcontainer.testing, name, None)), name


def test_every_exported_name_imports_from_the_package() -> None:
    import mdbcontainer

    missing = [name for name in mdbcontainer.__all__ if not hasattr(mdbcontainer, name)]
    assert not missing, f"in __all__ but not importable: {missing}"


# -- one exception tree -------------------------------------------------------------------------


def test_every_error_a_user_meets_is_in_the_tree_and_exported() -> None:
    import importlib
    import inspect
    import pkgutil

    import mdbcontainer
    from mdbcontainer import errors

    tree = {name: cls for name, cls in vars(errors).items()
            if inspect.isclass(cls) and issubclass(cls, Exception)}
    for name, cls in tree.items():
        assert issubclass(cls, mdbcontainer.MdbError), name
        assert name in mdbcontainer.__all__, f"{name} is not exported"
        assert re.search(rf"^ +(\W+ )?{name} ", errors.__doc__ or "", re.M), f"{name} not in the tree"
    # No error class of the package's own lives outside errors.py (the embedded broker's
    # transport errors are kombu's, not the package's).
    for info in pkgutil.walk_packages(mdbcontainer.__path__, "mdbcontainer."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, mdbcontainer.MdbError):
                assert cls.__module__ == "mdbcontainer.errors", f"{info.name}.{name}"


def test_exit_codes_live_on_the_error_classes() -> None:
    from mdbcontainer import errors

    assert errors.SettingsError.exit_code == errors.ListenerError.exit_code == 2
    for cls in (errors.MdbError, errors.BrokerUnavailable, errors.Unroutable, errors.DlqError,
                errors.SubscriptionInUse, errors.NoReplyTo, errors.TransactionError):
        assert cls.exit_code == 1, cls


def test_library_callers_keep_the_cause(tmp_path: Path) -> None:
    import tomllib

    from mdbcontainer import SettingsError, load_settings

    path = tmp_path / "settings.toml"
    path.write_text("[container\n")
    with pytest.raises(SettingsError) as err:
        load_settings(path, environ={})
    assert isinstance(err.value.__cause__, tomllib.TOMLDecodeError)


def test_a_reply_to_a_message_without_reply_to_is_no_reply_to() -> None:
    from mdbcontainer import Message, MessageContext, NoReplyTo, TransactionError

    ctx = MessageContext(Message(id="m-1", body={}), "Orders", unit=None)  # type: ignore[arg-type]
    with pytest.raises(NoReplyTo, match="port 'Orders': message m-1 has no reply_to") as err:
        ctx.reply({"ok": True})
    assert not isinstance(err.value, TransactionError), "no transaction API was misused"
