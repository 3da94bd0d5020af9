"""What the operating commands do (``mdb dlq``, ``mdb ports``, ``mdb unsubscribe``, ``mdb check``)."""
