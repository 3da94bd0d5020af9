"""The ``mdb`` command: parse, load settings, delegate, print."""
