"""Logging setup: one format for every kvflow module."""

from __future__ import annotations

import logging
import sys

from kvflow import envs

_FORMAT = "%(levelname)s %(asctime)s.%(msecs)03d [%(name)s] %(message)s"
_DATEFMT = "%H:%M:%S"


def init_logger(name: str) -> logging.Logger:
    """Return the logger for a kvflow module; the ``kvflow`` root gets a handler once."""
    root = logging.getLogger("kvflow")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
        root.addHandler(handler)
        root.setLevel(envs.log_level())
        root.propagate = False
    return logging.getLogger(name)
