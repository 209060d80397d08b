"""Settings that check themselves: how a configuration slice declares its keys.

A slice (`KVTierConfig`'s core keys, `DiskConfig`, `RedisConfig`, …) is a frozen dataclass whose
fields are declared with `setting(default, check, help)`. Its `__post_init__` calls `validate`,
so every way of building it — `from_dict`, the constructor, `dataclasses.replace` — is checked:
a bad value is a `ConfigError` that names the user's key. A field's user key is the slice's
`KEY_PREFIX` plus the field's name unless the field names its own (`key=`). Its `help` is
a whole sentence: the CLI shows it beside the field's flag.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import Field, field, fields, is_dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policies import policy_names

__all__ = [
    "Check",
    "choice",
    "flag",
    "integer",
    "key_of",
    "matching",
    "parse_size",
    "policy",
    "seconds",
    "setting",
    "size",
    "slice_fields",
    "text",
    "validate",
]

# (user key, value) -> the value to keep; raises ConfigError
Check = Callable[[str, Any], Any]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# fullmatch: "$" would take a trailing newline
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
# what every size field of a header, a file offset or a C size_t holds
_MAX_BYTES = 2**63 - 1
# ~30 years: larger is a typo (and overflows float conversions and timers)
_MAX_SECONDS = 10.0**9
# counts and milliseconds: larger ones overflow C ints in timers and sockets
_MAX_INT = 2**31 - 1


def setting(default: Any, check: Check, help: str, *, key: str | None = None) -> Any:
    """A checked field: `default`, the `check` its value passes, one sentence of `help`, and
    `key` when the user's key is not the slice's prefix plus the field's name."""
    return field(default=default, metadata={"check": check, "help": help, "key": key})


def key_of(cls: type, f: Field) -> str:
    """The user's key of field `f` of slice `cls`."""
    return f.metadata.get("key") or getattr(cls, "KEY_PREFIX", "") + f.name


def validate(obj: Any) -> None:
    """Run every checked field of slice `obj` through its check, keeping what the check returns
    (a size given as "4GiB" is kept as bytes). Raises ConfigError naming the user's key."""
    for f in fields(obj):
        check = f.metadata.get("check")
        if check is not None:
            object.__setattr__(obj, f.name, check(key_of(type(obj), f), getattr(obj, f.name)))


def slice_fields(cls: type) -> Iterator[tuple[str, Field, tuple[str, ...]]]:
    """(user key, field, path of slice attributes) for every checked field of `cls` and of the
    slices it holds, in declaration order: the flat view a user's dict and the CLI have."""
    for f in fields(cls):
        if "check" in f.metadata:
            yield key_of(cls, f), f, ()
        elif is_dataclass(f.default_factory):
            for key, inner, path in slice_fields(f.default_factory):
                yield key, inner, (f.name, *path)


def parse_size(value: Any, key: str = "size") -> int:
    """Bytes from an int or a string like "4GiB", "512 MiB", "2e9"-free "2000000000"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '4GiB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        num_bytes = value
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)) and m.group(2).lower() in _UNITS:
        # inf for 400 digits: refused below
        num_bytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
    else:
        raise ConfigError(
            f"{key}: expected a size like '4GiB', '512MiB' or a number of bytes, got {_short(value)}"
        )
    if not 0 < num_bytes <= _MAX_BYTES:
        raise ConfigError(
            f"{key}: must be positive and at most {_MAX_BYTES} (8 EiB), got {_short(value)}"
        )
    return int(num_bytes)


def size(key: str, value: Any) -> int:
    """A positive number of bytes, or a size like "4GiB"."""
    return parse_size(value, key)


def quotas(key: str, value: Any) -> tuple[tuple[str, int], ...]:
    """Bytes per tenant: {"tenant-a": "2GiB", "*": "512MiB"}, or the text "tenant-a=2GiB,*=512MiB"
    (a command-line flag); () for none. Kept as sorted (tenant, bytes) pairs (a frozen config)."""
    if value is None or value == {} or value == ():
        return ()
    if isinstance(value, str):
        pairs = [item.rpartition("=") for item in value.split(",") if item.strip()]
        if any(not sep or not name.strip() for name, sep, _ in pairs):
            raise ConfigError(f"{key}: expected 'tenant=size,*=size', got {_short(value)}")
        value = {name.strip(): amount.strip() for name, _, amount in pairs}
    # (tenant, size) pairs, as `to_dict` gives them back; a tenant that is not text is refused
    # below (as a dict key, a list would not even hash)
    is_pairs = isinstance(value, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in value
    )
    if is_pairs:
        value = dict(value)
    if not isinstance(value, dict) or not all(
        isinstance(t, str) and 0 < len(t) <= 256 for t in value
    ):
        raise ConfigError(
            f"{key}: expected {{tenant (cache_salt) or '*': size}}, got {_short(value)}"
        )
    return tuple(
        sorted(
            (tenant, parse_size(amount, f"{key}[{tenant!r}]")) for tenant, amount in value.items()
        )
    )


def integer(minimum: int) -> Check:
    """An int of at least `minimum` (and at most 2**31 - 1)."""

    def check(key: str, value: Any) -> int:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not minimum <= value <= _MAX_INT
        ):
            raise ConfigError(
                f"{key}: expected an integer >= {minimum} (at most {_MAX_INT}), got {_short(value)}"
            )
        return value

    return check


def seconds(minimum: float, optional: bool = False) -> Check:
    """Seconds, at least `minimum`; None too when `optional`."""

    def check(key: str, value: Any) -> float | None:
        if optional and value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not minimum <= value <= _MAX_SECONDS
        ):
            raise ConfigError(
                f"{key}: expected seconds >= {minimum:g} (at most {_MAX_SECONDS:g}), got {_short(value)}"
            )
        return float(value)

    return check


def flag(key: str, value: Any) -> bool:
    """True or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_short(value)}")
    return value


def choice(*allowed: Any) -> Check:
    """One of `allowed` (True and False match only themselves, never 1 or 0)."""

    def check(key: str, value: Any) -> Any:
        if not any(value is c or (isinstance(c, str) and value == c) for c in allowed):
            raise ConfigError(f"{key}: expected one of {list(allowed)}, got {_short(value)}")
        return value

    return check


def policy(key: str, value: Any) -> str:
    """A registered eviction policy's name, or an out-of-tree "module:Class"."""
    if not isinstance(value, str) or (value not in policy_names() and ":" not in value):
        raise ConfigError(
            f"{key}: expected one of {policy_names()} or 'module:Class', got {_short(value)}"
        )
    return value


def text(key: str, value: Any) -> str | None:
    """A non-empty string (a path or a name) or None; a file it names is read at start, never here."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise ConfigError(f"{key}: expected a non-empty string or null, got {type(value).__name__}")
    return value


def matching(pattern: str) -> Check:
    """A string matching `pattern` whole (fullmatch: "$" alone would let a trailing newline into a
    key name or a URL), or None."""
    compiled = re.compile(pattern)

    def check(key: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not compiled.fullmatch(value):
            raise ConfigError(f"{key}: expected a string matching {pattern}")
        return value

    return check


def _short(value: Any) -> str:
    """`repr(value)`, cut to a line: a message must stay readable whatever was passed."""
    return reprlib.repr(value)
