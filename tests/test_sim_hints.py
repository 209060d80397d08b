"""Client hints in the simulator (issue 23): derived from a trace's conversations, made noisy,
carried to the scheduler; and the agentic trace generator they are measured on."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace
from itertools import pairwise

from kvtier.scheduler import OffloadScheduler, parse_kv_transfer_params
from kvtier.sim import SimOptions, simulate, synthetic
from kvtier.sim.agentic import agentic, agentic_turns
from kvtier.sim.hints import NEXT_TURN_SLACK, find_conversations, hints_for, replay_pace, with_hints
from kvtier.sim.trace import ClientHints, TraceRequest


def req(*hash_ids: int, whole: int | None = None) -> TraceRequest:
    """A request of `hash_ids`, all whole blocks but the last (or `whole` of them)."""
    num_whole = len(hash_ids) - 1 if whole is None else whole
    return TraceRequest(
        0, num_whole * 512 + (100 if num_whole < len(hash_ids) else 0), 10, hash_ids
    )


def test_a_later_request_that_extends_a_prompt_is_its_next_turn():
    # 4: A, turn 3: extends [1, 2, 4]
    trace = [
        # 0: conversation A, turn 1: whole blocks [1, 2]
        req(1, 2, 3),
        # 1: B, one turn
        req(10, 11),
        # 2: A, turn 2: extends [1, 2] -> A's next turn
        req(1, 2, 4, 5),
        # 3: C, one turn
        req(20, 21, 22),
        req(1, 2, 4, 6, 7),
    ]
    found = find_conversations(trace)
    assert found.session == [0, 1, 0, 3, 0]
    assert found.next_turn == [2, None, 4, None, None]
    assert found.is_last == [False, True, False, True, True]
    # hints at 0.01 simulated seconds per request: a next turn 2 requests later, with the slack
    hints = hints_for(found, 0.01)
    assert hints[0] == ClientHints("s0", next_turn_s=2 * 0.01 * NEXT_TURN_SLACK)
    assert hints[4] == ClientHints("s0", end_session=True)
    assert [h.end_session for h in hints] == [False, True, False, True, True]


def test_a_sub_agent_joins_its_parents_session_and_its_last_turn_ends_nothing():
    # 3: the agent goes on from its own prefix: the session's last
    trace = [
        # 0: the agent
        req(1, 2, 3),
        # 1: a sub-agent from the agent's prefix: the agent's next turn
        req(1, 2, 8, 9),
        # 2: the sub-agent again (extends [1, 2, 8]); its last turn
        req(1, 2, 8, 10),
        req(1, 2, 4, 5),
    ]
    found = find_conversations(trace)
    assert found.session == [0, 0, 0, 0]
    assert found.next_turn == [1, 2, None, None]
    hints = hints_for(found, 0.01)
    # a leaf while the session goes on: neither hint
    assert hints[2] == ClientHints("s0")
    assert hints[3].end_session


def test_a_shared_prefix_links_no_conversations():
    # 0 starts many prompts (a system prompt): followed by 6 different whole blocks
    starts = [req(0, 10 + i, 100 + i) for i in range(6)]
    # another conversation, not request 0's next turn
    trace = [
        # whole blocks [0] only: nothing of its own
        req(0, 50, whole=1),
        *starts,
        req(0, 60, 61, whole=2),
    ]
    found = find_conversations(trace)
    assert found.session == list(range(len(trace)))
    # a block two conversations sent links neither: 7 is sent by 0 and 1, then 1 ends on it
    trace = [req(7, 8, 9), req(7, 30, whole=1), req(7, 40, 41)]
    assert find_conversations(trace).session == [0, 1, 2]


def test_noisy_hints_are_wrong_about_one_request_in_five_in_each_way():
    # 2,897 requests
    trace = synthetic(400, seed=3)
    found = find_conversations(trace)
    exact = hints_for(found, 0.01)
    noisy = hints_for(found, 0.01, error=0.2, seed=1)
    wrong = [(e, n) for e, n in zip(exact, noisy, strict=True) if e != n]
    assert 0.17 < len(wrong) / len(trace) < 0.23
    # a client knows its own conversation
    assert all(e.session == n.session for e, n in wrong)
    missing = sum(
        1 for e, n in wrong if e.next_turn_s and n.next_turn_s is None and not n.end_session
    )
    ended_early = sum(1 for e, n in wrong if e.next_turn_s and n.end_session)
    phantom = sum(1 for e, n in wrong if e.next_turn_s is None and n.next_turn_s)
    assert min(missing, ended_early, phantom) > 0 and missing + ended_early + phantom == len(wrong)
    # seeded
    assert hints_for(found, 0.01, error=0.2, seed=1) == noisy


def test_agent_sessions_have_tens_of_turns_and_a_growing_context():
    turns = agentic_turns(30, seed=5)
    by_agent = defaultdict(list)
    for turn in turns:
        by_agent[turn.session, turn.agent].append(turn.request)
    main_turns = [len(requests) for (_, agent), requests in by_agent.items() if agent == 0]
    assert (
        len(main_turns) == 30
        and 25 <= statistics.median(main_turns) <= 65
        and min(main_turns) >= 10
    )
    shares = []
    for requests in by_agent.values():
        for before, after in pairwise(requests):
            # each turn re-sends the previous prompt (its whole blocks) and adds to it
            assert after.input_length > before.input_length
            assert (
                after.hash_ids[: before.num_full_blocks()]
                == before.hash_ids[: before.num_full_blocks()]
            )
            shares.append(before.input_length / after.input_length)
    # agent traffic: > 96 % prefix hits at full size
    assert statistics.fmean(shares) > 0.94
    timestamps = [turn.request.timestamp_ms for turn in turns]
    assert timestamps == sorted(timestamps)
    # sessions interleave: tens of them between a session's first and last request
    first = {t.session: i for i, t in reversed(list(enumerate(turns)))}
    last = {t.session: i for i, t in enumerate(turns)}
    running = statistics.median(
        sum(1 for s in first if first[s] <= i <= last[s]) for i in range(len(turns))
    )
    assert running >= 10


def test_sub_agents_start_from_their_parents_prefix():
    turns = agentic_turns(30, seed=5)
    seen: set[tuple[int, int]] = set()
    # each sub-agent's first request, with its index
    subs = []
    for index, turn in enumerate(turns):
        if turn.agent > 0 and (turn.session, turn.agent) not in seen:
            subs.append((index, turn))
        seen.add((turn.session, turn.agent))
    assert subs
    for index, sub in subs:
        parent = next(
            t.request for t in reversed(turns[:index]) if t.session == sub.session and t.agent == 0
        )
        whole = parent.num_full_blocks()
        assert sub.request.hash_ids[:whole] == parent.hash_ids[:whole]
        assert sub.request.input_length > parent.input_length


def test_the_agentic_trace_is_seeded_and_its_sessions_are_found_apart():
    assert agentic(5, seed=3) == agentic(5, seed=3) != agentic(5, seed=4)
    turns = agentic_turns(20, seed=2)
    found = find_conversations([t.request for t in turns])
    sessions = defaultdict(set)
    for turn, session in zip(turns, found.session, strict=True):
        sessions[session].add(turn.session)
    # no two sessions merged
    assert all(len(true) == 1 for true in sessions.values())
    linked = sum(1 for nxt in found.next_turn if nxt is not None)
    # most turns are found continuing
    assert linked > 0.9 * (len(turns) - 20 - 2 * len(sessions))


def test_hints_reach_the_scheduler_as_kv_transfer_params(monkeypatch):
    trace = synthetic(12, seed=7, conversations_per_s=2.0)
    options = SimOptions(host_slots=40, engine_blocks=64, max_running=2, hints="exact")
    seen: dict[str, object] = {}
    lookup = OffloadScheduler.get_num_new_matched_tokens

    def record(self, request, num_local):
        seen.setdefault(request.req_id, request.kv_transfer_params)
        return lookup(self, request, num_local)

    monkeypatch.setattr(OffloadScheduler, "get_num_new_matched_tokens", record)
    simulate(trace, options)
    hinted = with_hints(trace, replay_pace(trace, options))
    assert seen == {str(i): {"kvtier": r.hints.to_params()} for i, r in enumerate(hinted)}
    assert any(r.hints.next_turn_s for r in hinted) and any(r.hints.end_session for r in hinted)
    # the stack reads them
    assert parse_kv_transfer_params(seen["0"], "0").hints.session == "s0"
    # no hints asked: the requests carry none; hints a caller attached travel as they are
    seen.clear()
    simulate(trace, replace(options, hints="trace"))
    assert set(seen.values()) == {None}
    seen.clear()
    simulate(
        [replace(r, hints=ClientHints(priority=2)) for r in trace], replace(options, hints="trace")
    )
    assert set(map(str, seen.values())) == {str({"kvtier": {"priority": 2}})}
