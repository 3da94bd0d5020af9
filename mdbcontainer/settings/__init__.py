"""Settings: the TOML file, its ``MDB_...`` environment overrides, and validation.

``models`` says what the file may hold, ``loading`` reads it (and the
environment) and names the file and key of any fault, ``durations`` reads and
prints ``"30s"``, ``urls`` hides the URLs' passwords. The names the rest of the package imports are here.
"""

from __future__ import annotations

from .durations import format_duration, parse_duration
from .loading import load_settings, settings_from_dict, validate_port
from .models import (
    EMBEDDED_DEFAULT_FILE,
    ContainerSettings,
    PortFields,
    PortSettings,
    QueueSettings,
    Settings,
    broker_urls,
)
from .urls import mask_url

__all__ = [
    "EMBEDDED_DEFAULT_FILE",
    "ContainerSettings",
    "PortFields",
    "PortSettings",
    "QueueSettings",
    "Settings",
    "broker_urls",
    "format_duration",
    "load_settings",
    "mask_url",
    "parse_duration",
    "settings_from_dict",
    "validate_port",
]
