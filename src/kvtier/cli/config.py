"""`kvtier config`: vLLM's `--kv-transfer-config` JSON from command-line flags.

Every user key of `kvtier.config.KVTierConfig` is a flag (`disk_path` -> `--disk-path`), so a
key added there is a flag here with no change; only the flags given go into the JSON, and
the result is validated by `KVTierConfig.from_dict` exactly as the engine will at start.
`--kv-role` is vLLM's `kv_role` beside them (kv_both unless given: kv_producer for prefill
engines, kv_consumer for decode engines, see `kvtier proxy`). `kvtier serve` takes the same flags.

Nothing printed here is a secret: the configuration holds none by design (passwords, S3 keys
and the key secret come from files it names or the environment), a Redis URL holding a
password is refused, and the refusal never repeats the URL.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import MISSING, fields
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.settings import slice_fields

__all__ = [
    "KV_ROLES",
    "add_config_flags",
    "add_dataclass_flags",
    "config_main",
    "extra_config",
    "given_flags",
    "transfer_config",
]

CONNECTOR = {
    "kv_connector": "KVTierConnector",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
# vLLM's KVRole values; the first is the default
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
# argparse destinations of the config flags: never clash with another command's
_DEST_PREFIX = "kvtier_"
_DOC_LINE = re.compile(r"^\s+([a-z0-9_*][a-z0-9_*, /]*): (.*)$")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per user key of `KVTierConfig` (its core keys and every tier's slice), in a group
    of their own, its help the key's own sentence; unset flags stay out of the JSON. And
    `--kv-role` (`args.kv_role`), the connector's role in vLLM."""
    parser.add_argument(
        "--kv-role",
        choices=KV_ROLES,
        default=KV_ROLES[0],
        help="vLLM's kv_role in the transfer config: kv_producer for a prefill engine, "
        "kv_consumer for a decode engine (behind `kvtier proxy`), kv_both for an engine that "
        "does both (default: kv_both).",
    )
    group = parser.add_argument_group(
        "kvtier options (keys of kv_connector_extra_config; see README)"
    )
    for key, f, _ in slice_fields(KVTierConfig):
        _add_flag(group, key, str(f.type), f.default, f.metadata["help"], _DEST_PREFIX)


def extra_config(args: argparse.Namespace) -> dict[str, Any]:
    """`kv_connector_extra_config` from the flags that were given, validated.

    Raises:
        ConfigError: a value `KVTierConfig` refuses (the message names the key).
    """
    extra = given_flags(args, _DEST_PREFIX)
    KVTierConfig.from_dict(extra)
    return extra


def add_dataclass_flags(group, cls: type, dest_prefix: str, skip: tuple[str, ...] = ()) -> None:
    """A flag per field of dataclass `cls` (`a_b` -> `--a-b`), its help from the class docstring.

    Bools are `--x/--no-x`; `*_bytes` ints take sizes ("4GiB"); every default is None, so
    `given_flags` returns only what the user set.
    """
    docs = _field_docs(cls)
    for f in fields(cls):
        if f.name not in skip:
            _add_flag(
                group,
                f.name,
                str(f.type),
                None if f.default is MISSING else f.default,
                docs.get(f.name, ""),
                dest_prefix,
            )


def _add_flag(group, name: str, kind: str, default: Any, text: str, dest_prefix: str) -> None:
    flag = "--" + name.replace("_", "-")
    # a docstring's entry starts lower-case
    text = (text[:1].upper() + text[1:]).replace("%", "%%")
    # a text that explains its default keeps it
    if "(default:" not in text:
        text = f"{text} (default: {_shown(default)})".strip()
    dest = dest_prefix + name
    if kind == "bool":
        group.add_argument(
            flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=text
        )
    else:
        group.add_argument(
            flag,
            dest=dest,
            metavar=_metavar(name, kind),
            default=None,
            help=text,
            type=_converter(name, kind),
        )


def given_flags(args: argparse.Namespace, dest_prefix: str) -> dict[str, Any]:
    """{field: value} of the flags `add_dataclass_flags(..., dest_prefix)` made that were given."""
    return {
        name[len(dest_prefix) :]: value
        for name, value in vars(args).items()
        if name.startswith(dest_prefix) and value is not None
    }


def transfer_config(extra: dict[str, Any], kv_role: str = KV_ROLES[0]) -> dict[str, Any]:
    """The whole `--kv-transfer-config` object for kvtier: `extra` its kvtier settings, `kv_role`
    vLLM's role for the connector (one of `KV_ROLES`)."""
    return {**CONNECTOR, "kv_role": kv_role, "kv_connector_extra_config": extra}


def config_main(args: argparse.Namespace, out) -> int:
    """Print the `--kv-transfer-config` JSON (compact with --json, else with a usage line)."""
    text = json.dumps(transfer_config(extra_config(args), args.kv_role), separators=(",", ":"))
    if args.json:
        print(text, file=out)
    else:
        print(f"vllm serve MODEL --kv-transfer-config '{text}'", file=out)
    return 0


def _converter(name: str, kind: str):
    # a flag that is not given is None already
    kind = kind.removesuffix(" | None")
    if name.endswith("_bytes") and kind == "int":
        return _size
    if kind == "int":
        return int
    if kind == "float":
        return float
    if kind == "str | bool":
        return _auto_or_bool
    return str


def _size(text: str) -> int | str:
    """Sizes stay text ("4GiB") for `parse_size`, or become an int when they are a number of bytes."""
    return int(text) if text.isdigit() else text


def _auto_or_bool(text: str) -> str | bool:
    choices = {"auto": "auto", "true": True, "false": False}
    if text.lower() not in choices:
        raise argparse.ArgumentTypeError(f"expected auto, true or false, got {text!r}")
    return choices[text.lower()]


def _metavar(name: str, kind: str) -> str:
    if name.endswith("_bytes"):
        return "SIZE"
    if name.endswith("_per_s"):
        return "RATE"
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("_ms"):
        return "MS"
    return {"int": "N", "int | None": "N", "str | bool": "auto|true|false"}.get(
        kind, name.rsplit("_", 1)[-1].upper()
    )


def _shown(default: Any) -> str:
    if (
        isinstance(default, int)
        and not isinstance(default, bool)
        and default >= 2**20
        and default % 2**20 == 0
    ):
        return f"{default // 2**30}GiB" if default % 2**30 == 0 else f"{default // 2**20}MiB"
    return json.dumps(default)


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's whole text from a docstring's "name: text" entries, with the lines it continues
    on (indented deeper); "a / b: text" and "a, b: text" give two fields one text."""
    docs: dict[str, str] = {}
    names: list[str] = []
    indent = 0
    for line in (cls.__doc__ or "").splitlines():
        m = _DOC_LINE.match(line)
        if m:
            names = [name.strip() for name in re.split(r" / |, ", m.group(1))]
            indent = len(line) - len(line.lstrip())
            for name in names:
                docs.setdefault(name, m.group(2).strip())
        elif names and line.strip() and len(line) - len(line.lstrip()) > indent:
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return docs
