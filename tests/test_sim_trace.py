"""Traces for the simulator: the Mooncake reader, the synthetic generator, and how a trace
request becomes a fake-engine request."""

from __future__ import annotations

import json

import pytest

from kvtier.keys import OFFLOAD_KEY_BYTES
from kvtier.sim import TraceError, TraceRequest, load_mooncake, parse_mooncake, synthetic
from kvtier.sim.trace import offload_keys
from kvtier.sim.workload import (
    engine_output_tokens,
    engine_prompt,
    hittable_blocks,
    num_unique_blocks,
)


def line(timestamp=0, input_length=1000, output_length=10, hash_ids=(0, 1)) -> str:
    return json.dumps(
        {
            "timestamp": timestamp,
            "input_length": input_length,
            "output_length": output_length,
            "hash_ids": list(hash_ids),
        }
    )


def test_reads_every_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n\n" + line(5, 512, 3, (0,)) + "\n")
    assert load_mooncake(path) == [TraceRequest(0, 1000, 10, (0, 1)), TraceRequest(5, 512, 3, (0,))]
    # limit stops early
    assert load_mooncake(path, limit=1) == [TraceRequest(0, 1000, 10, (0, 1))]


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (line(hash_ids=(0, "x")), "'hash_ids' must be a list of non-negative integers"),
        (
            json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}),
            "'hash_ids'.*missing",
        ),
        (line(input_length=0), "'input_length' must be an integer >= 1"),
        (line(output_length=-1), "'output_length' must be an integer >= 0"),
        (line(input_length=True), "'input_length' must be an integer"),
        (line(timestamp="now"), "'timestamp' must be a non-negative number"),
        (
            line(input_length=1000, hash_ids=(0, 1, 2)),
            "3 hash_ids for input_length 1000: expected 2",
        ),
    ],
)
def test_a_malformed_line_is_rejected_with_its_number(bad, reason):
    # lines 1 and 2 are fine (2 blank), line 3 is not
    with pytest.raises(TraceError, match=rf"^trace\.jsonl: line 3: {reason}"):
        parse_mooncake([line(), "", bad], source="trace.jsonl")


def test_a_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_mooncake(tmp_path / "nope.jsonl")


def test_another_block_size_is_named_in_the_error_and_accepted_when_given():
    with pytest.raises(TraceError, match="pass block_tokens"):
        parse_mooncake([line(input_length=40, hash_ids=(0, 1, 2))])
    assert parse_mooncake([line(input_length=40, hash_ids=(0, 1, 2))], block_tokens=16)[
        0
    ].hash_ids == (0, 1, 2)


def test_offload_keys_name_one_chunk_per_id():
    keys = offload_keys([7, 8])
    assert [len(k) for k in keys] == [OFFLOAD_KEY_BYTES] * 2 and keys[0] != keys[1]
    assert keys[0][:32] == (7).to_bytes(32, "big") and keys[0][32:] == b"\0\0\0\0"


# -- synthetic -----------------------------------------------------------------------------


def test_synthetic_traces_repeat_with_the_seed_and_read_back_as_mooncake():
    trace = synthetic(40, seed=5)
    assert trace == synthetic(40, seed=5) and trace != synthetic(40, seed=6)
    assert [r.timestamp_ms for r in trace] == sorted(r.timestamp_ms for r in trace)
    # every request is valid Mooncake: one id per 512-token block
    lines = [line(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in trace]
    assert parse_mooncake(lines) == trace


def test_synthetic_ids_are_prefix_ids_and_turns_resend_the_history():
    trace = synthetic(60, seed=1, agent_fraction=0.5, num_system_prompts=2)
    # an id always follows the same id: it names its whole prefix
    parent: dict[int, int | None] = {}
    for req in trace:
        for i, h in enumerate(req.hash_ids):
            assert parent.setdefault(h, req.hash_ids[i - 1] if i else None) == (
                req.hash_ids[i - 1] if i else None
            )
    # two system prompts: every request starts with one of two first blocks
    assert len({r.hash_ids[0] for r in trace}) == 2
    # some later request extends each multi-turn conversation's whole blocks (the history is re-sent)
    full = {r.hash_ids[: r.num_full_blocks()] for r in trace if r.num_full_blocks() >= 3}
    extended = [
        p
        for p in full
        if any(len(r.hash_ids) > len(p) and r.hash_ids[: len(p)] == p for r in trace)
    ]
    assert len(extended) > len(full) // 4


# -- workload: trace request -> engine request ---------------------------------------------


def test_each_whole_trace_block_becomes_one_engine_block_and_a_partial_one_a_token():
    # 2 whole blocks of 512 + 76 tokens
    req = TraceRequest(0, 1100, 300, (4, 5, 6))
    assert engine_prompt(req, 512, 2) == [8, 9, 10, 11, 12]
    assert list(hittable_blocks(req, 512)) == [4, 5]
    assert engine_output_tokens(req, 512, 2) == 1
    # whole blocks only: the last one is recomputed to sample, so it is never a hit
    exact = TraceRequest(0, 1024, 0, (4, 5))
    assert engine_prompt(exact, 512, 2) == [8, 9, 10, 11] and list(hittable_blocks(exact, 512)) == [
        4
    ]
    assert num_unique_blocks([req, exact]) == 3
