"""Environment switches that turn a fast path off (to compare it with the path it replaces, or to step around it)."""

from __future__ import annotations

import os

OFF = frozenset({"0", "false", "off", "no"})


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its path off (``0``, ``false``, ``off`` or ``no``, in any case
    and with spaces around; unset or anything else leaves it on)."""
    return os.environ.get(name, "1").strip().lower() in OFF
