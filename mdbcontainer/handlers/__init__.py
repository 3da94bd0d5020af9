"""Handlers: ``@message_driven``, finding handlers and calling them by their signatures."""
