"""On/off switches from the environment, read the same way by every module.

Every ``DISTLINALG_*`` switch takes 1/0, true/false, yes/no or on/off (any
case, surrounding blanks ignored); unset or empty means the default. Any
other value raises ValueError at import, on every rank (mpiexec gives the
ranks the same environment), so that a typo neither turns a safety net off
nor silently leaves a feature on.
"""

from __future__ import annotations

import os

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def parse_flag(name: str, value: str | None, default: bool) -> bool:
    """`value` of the switch `name` as a bool: unset or empty gives `default`.

    Raises ValueError for anything but 1/0, true/false, yes/no, on/off.

    Example:
      >>> parse_flag("DISTLINALG_DEBUG", " Yes", False), parse_flag("DISTLINALG_DEBUG", "", True)
      (True, True)
    """
    if value is None or not value.strip():
        return default
    word = value.strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(f"distlinalg: {name}={value!r} is not a switch; use 1 or 0 (true/false, yes/no, on/off)")


def switch(name: str, default: bool) -> bool:
    """The environment variable `name` as an on/off switch (:func:`parse_flag`)."""
    return parse_flag(name, os.environ.get(name), default)
