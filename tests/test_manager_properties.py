"""Random operation sequences never break the CPU tier's invariants.

A hypothesis state machine drives CPUTierManager (both policies) with lookups,
stores that succeed or fail, loads, touches, request finishes and resets, and after
every step checks: `check()` (slot accounting, policy holds exactly the READY keys,
pin counts), that no pinned or PENDING key was evicted, and that the events replay
to exactly the set of readable keys.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import key, make_req_context
from kvtier import CPUTierManager, LookupResult

KEY_IDS = st.lists(st.integers(0, 7), min_size=1, max_size=4)
# stores mostly succeed, so loads happen
SUCCESS = st.sampled_from([True, True, True, False])
REQS = st.sampled_from(["a", "b", "c"])


class TierMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["lru", "arc"]),
        capacity=st.integers(1, 6),
        threshold=st.integers(1, 2),
    )
    def setup(self, policy, capacity, threshold):
        self.m = CPUTierManager(capacity, policy=policy, store_threshold=threshold)
        # prepared, not completed stores
        self.in_flight: list[tuple[str, list[bytes]]] = []
        # pinned, not completed loads
        self.loads: list[tuple[str, list[bytes]]] = []
        # replayed from events
        self.readable: set[bytes] = set()

    def _busy(self) -> set[bytes]:
        return {k for _, ks in self.in_flight + self.loads for k in ks}

    @rule(ids=KEY_IDS, req=REQS)
    def prepare_store(self, ids, req):
        busy = self._busy()
        out = self.m.prepare_store([key(i) for i in ids], make_req_context(req))
        if out is None:
            return
        # no pinned or PENDING key, and none of the call's own keys, is ever evicted
        assert not set(out.evicted_keys) & (busy | {key(i) for i in ids})
        self.in_flight.append((req, out.keys_to_store))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), success=SUCCESS)
    def complete_store(self, data, success):
        req, ks = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.m.complete_store(ks, make_req_context(req), success)

    @rule(ids=KEY_IDS, req=REQS)
    def load_hits(self, ids, req):
        ctx = make_req_context(req)
        hits = [
            key(i) for i in dict.fromkeys(ids) if self.m.lookup(key(i), ctx) is LookupResult.HIT
        ]
        if hits:
            spec = self.m.prepare_load(hits, ctx)
            assert len(spec) == len(hits)
            self.loads.append((req, hits))

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data):
        req, ks = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(ks, make_req_context(req))

    @rule(ids=KEY_IDS)
    def touch(self, ids):
        self.m.touch([key(i) for i in ids], make_req_context("t"))

    @rule(req=REQS)
    def finish_request(self, req):
        # the request's loads are over (an abort): the manager releases leftover pins
        self.loads = [(r, ks) for r, ks in self.loads if r != req]
        self.m.on_request_finished(make_req_context(req))

    @rule(roll=st.integers(0, 9))
    def reset(self, roll):
        # rare, or the tier would rarely fill up
        if roll == 0:
            self.m.reset()

    @invariant()
    def bookkeeping_is_consistent(self):
        if not hasattr(self, "m"):
            return
        self.m.check()
        s = self.m.stats()
        assert s.used_slots <= s.num_slots
        assert s.evictable_slots + s.pending_slots <= s.used_slots

    @invariant()
    def events_match_the_state(self):
        if not hasattr(self, "m"):
            return
        for event in self.m.take_events():
            assert event.medium == "cpu"
            if event.removed:
                assert set(event.keys) <= self.readable
                self.readable -= set(event.keys)
            else:
                assert not set(event.keys) & self.readable
                self.readable |= set(event.keys)
        ctx = make_req_context("probe")
        actual = {key(i) for i in range(8) if self.m.lookup(key(i), ctx) is LookupResult.HIT}
        assert actual == self.readable


TierMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestTierMachine = TierMachine.TestCase
