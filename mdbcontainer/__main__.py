"""``python -m mdbcontainer`` is ``mdb``."""

from .cli import main

main()
