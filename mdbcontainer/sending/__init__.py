"""Sending from outside a handler: ``Producer`` and request/reply."""
