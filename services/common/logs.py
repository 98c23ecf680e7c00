"""Logging set-up shared by every service: one line per event, level from config."""
from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup(level: str = "INFO") -> None:
    """Configure the root logger once (idempotent)."""
    root = logging.getLogger()
    if not any(getattr(h, "_tessera", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        handler._tessera = True
        root.addHandler(handler)
    root.setLevel(level.upper())
