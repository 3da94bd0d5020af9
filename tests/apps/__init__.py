"""Listener modules the tests deploy; their behaviour is chosen by each message's body."""
