"""kvtier's error hierarchy.

Every error kvtier raises on purpose derives from `KVTierError`; messages say what
to change. Engine-facing paths never raise these for a tier failure: they degrade
to a miss and count it.
"""

from __future__ import annotations

__all__ = ["ConfigError", "InvariantError", "KVTierError", "NotReadyError"]


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value or argument is invalid; the message names the fix."""


class NotReadyError(KVTierError, KeyError):
    """`prepare_load` was asked for a key that is not readable now (not a HIT)."""

    # KeyError would quote the message otherwise
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvariantError(KVTierError, AssertionError):
    """`check()` found the bookkeeping inconsistent (a bug, never bad input)."""
