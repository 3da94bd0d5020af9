"""``python -m mdbcontainer`` is ``mdb``."""

from .cli.main import main

main()
