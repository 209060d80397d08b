"""`kvtier serve`: vLLM's own OpenAI-compatible server, started with kvtier configured from flags.

One server for the module: `kvtier serve` on the tiny model, on a free loopback port, as a
subprocess (its output goes to a file, shown when something fails). Every wait is bounded.
Prompts are token ids: the tiny model has no tokenizer (`--skip-tokenizer-init`).
"""

from __future__ import annotations

import pytest

from helpers import wait_until
from serve_helpers import KVTIER, STOP_TIMEOUT_S, Server, mapped_slabs
from vllm_helpers import tokens


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    assert KVTIER is not None, "pip install -e . installs the `kvtier` console script"
    srv = Server(model, tmp_path_factory.mktemp("serve") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_serve_answers_a_completion_and_exposes_kvtier_metrics(server):
    # 4 whole blocks of 128 tokens: kvtier stores them
    prompt = tokens(600, seed=3)
    status, body = server.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 600
    # /metrics: kvtier's own series beside vLLM's; the request went through the connector
    status, text = server.get("/metrics")
    assert status == 200
    # summed over labels
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvtier:"):
            name = line.split("{")[0].split()[0]
            samples[name] = samples.get(name, 0.0) + float(line.split()[-1])
    assert samples.get("kvtier:num_slots", 0) > 0
    assert samples["kvtier:miss_tokens_total"] + samples["kvtier:hit_tokens_total"] >= 512


def test_serve_passes_kv_transfer_params_from_the_request_body_to_kvtier(server):
    """The hints API over HTTP: vLLM's OpenAI server hands `kv_transfer_params` to the connector,
    which counts the request as hinted; a malformed hint is ignored, the request still served."""

    def hinted_requests() -> float:
        status, text = server.get("/metrics")
        assert status == 200
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("kvtier:hinted_requests_total")
        )

    before = hinted_requests()
    for hints in (
        {"session": "chat-7", "retain_s": 300, "next_turn_s": 30},
        {"session": "chat-7", "end_session": True, "priority": "high"},
    ):
        status, body = server.post(
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": tokens(300, seed=8),
                "max_tokens": 2,
                "temperature": 0.0,
                "ignore_eos": True,
                "kv_transfer_params": {"kvtier": hints},
            },
        )
        assert status == 200, body
    # the stat logger ships counters with the engine's next steps
    wait_until(
        lambda: hinted_requests() >= before + 2, "both hinted requests are counted", interval_s=0.2
    )
    assert hinted_requests() == before + 2
    assert "kvtier hint 'priority' must be an integer" in server.log_path.read_text(
        errors="replace"
    )


def test_serve_stops_cleanly_on_ctrl_c(server):
    slabs = mapped_slabs(server.process.pid)
    assert slabs, "the running server's host slab is in /dev/shm"
    logged_before = len(server.log_path.read_text(errors="replace"))
    status = server.stop()
    assert (
        status is not None
    ), f"kvtier serve ignored SIGINT for {STOP_TIMEOUT_S} s:\n{server.log_tail()}"
    assert status == 0, server.log_tail()
    stopping = server.log_path.read_text(errors="replace")[logged_before:]
    # what the stop did, in every process (the full log is too long for a failure message)
    steps = "\n".join(
        line
        for line in stopping.splitlines()
        if "[shutdown]" in line or "kvtier" in line or "WARNING" in line or "ERROR" in line
    )
    # the engine's processes exit on their own (a killed EngineCore leaves kvtier's shared memory
    # behind), and kvtier's host slab is unlinked. Not asserted: no traceback — vLLM 0.32's API
    # server sometimes logs EngineDeadError from its output handler, still waiting for outputs when
    # the engine it stopped exits.
    assert "all workers exited gracefully" in stopping and "force killing" not in stopping, steps[
        -6000:
    ]
    assert not any(path.exists() for path in slabs), steps[-6000:]


def test_no_kvtier_flag_shadows_a_vllm_serve_option():
    """kvtier's flags are taken out before the rest goes to `vllm serve`: none may be vLLM's too."""
    from vllm.entrypoints.cli.serve import cmd_init
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvtier.cli.main import build_parser

    vllm_parser = FlexibleArgumentParser()
    (serve_cmd,) = cmd_init()
    serve_parser = serve_cmd.subparser_init(vllm_parser.add_subparsers())
    vllm_flags = {s for action in serve_parser._actions for s in action.option_strings}
    kvtier_serve = build_parser("serve")._subparsers._group_actions[0].choices["serve"]
    kvtier_flags = {s for action in kvtier_serve._actions for s in action.option_strings} - {
        "-h",
        "--help",
    }
    assert len(kvtier_flags) > 40 and kvtier_flags & vllm_flags == set()
    # and the JSON it builds is a KVTransferConfig vLLM accepts
    from vllm.config import KVTransferConfig

    from kvtier.cli.config import transfer_config

    config = KVTransferConfig(**transfer_config({"cpu_bytes": "1GiB"}))
    assert config.kv_connector == "KVTierConnector" and config.kv_load_failure_policy == "recompute"
