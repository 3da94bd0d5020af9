"""The record: ``python -m tests.record.run --seed N --minutes M`` (``make record``).

``postgres`` holds the replicated PostgreSQL pair, ``checker`` the count of
lost, duplicated, unexpected and recovered messages, ``run`` the fleet, the
faults and the driver (CONTRACT.md, section 19; docs/production/record.md).
"""
