"""Foundations every layer may use: logging, crash points, the retry policy, outgoing messages."""
