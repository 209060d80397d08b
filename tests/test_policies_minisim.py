"""The miniature simulations' sample (`kvtier.policies.minisim`): past a size it thins by doubling
(`thinned`, SHARDS's fixed-size variant), so a thinner slice is a subset of the one the policies
were tuned on, and a replay of the same traffic makes the same choices every time.

Keys are numbered (helpers.key).
"""

from __future__ import annotations

import random

import pytest

from helpers import access, key
from kvtier.policies import AdaptivePolicy, TurnsPolicy
from kvtier.policies.minisim import PolicySelector, SettingSelector, is_sampled, thinned


@pytest.mark.parametrize(
    ("sample", "capacity", "max_keys", "expected"),
    [
        (4, 100_000, None, 4),
        (4, 8192, 2048, 4),
        (4, 8193, 2048, 8),
        (4, 32_768, 2048, 16),
        (8, 32_768, 1024, 32),
        (1, 3, 1, 4),
    ],
)
def test_a_sample_doubles_until_each_miniature_fits_its_most_slots(
    sample, capacity, max_keys, expected
):
    assert thinned(sample, capacity, max_keys) == expected


def test_a_thinner_sample_watches_a_subset_of_the_keys_the_thicker_one_watched():
    keys = [key(i) for i in range(20_000)]
    for sample in (4, 8):
        thin = thinned(sample, 64 * sample * 4, 64)
        assert thin == 4 * sample
        watched = {k for k in keys if is_sampled(k, thin)}
        assert watched and watched <= {k for k in keys if is_sampled(k, sample)}


def test_setting_miniatures_past_their_most_slots_watch_the_thinned_slice():
    selector = SettingSelector(32_768, [0.0, 1.0], lambda s, level: s, sample=4, max_keys=2048)
    assert selector.sample == 16
    assert all(mini.capacity == 2048 for mini in selector._minis)
    assert [selector.is_watched(key(i)) for i in range(500)] == [
        is_sampled(key(i), 16) for i in range(500)
    ]


def test_the_policies_bound_their_miniatures_at_a_large_capacity():
    adaptive = AdaptivePolicy(32_768)
    assert adaptive.selector.sample == 16
    assert all(mini.capacity == 2048 for mini in adaptive.selector.minis.values())
    assert adaptive.policies["turns"].selector.sample == 16
    # below the bound nothing changes
    assert TurnsPolicy(8192).selector.sample == TurnsPolicy.sample
    assert PolicySelector(4096, ["a"], lambda name, c: TurnsPolicy(c), max_keys=2048).sample == 8


class SmallMiniatures(AdaptivePolicy):
    """Miniatures bounded at 64 slots, so a 1,024-key policy runs thinned ones."""

    max_keys = 64


def replay(seed: int) -> tuple[list[str], list[list[bytes]]]:
    """A seeded stream of prefix lookups and stores through a thinned adaptive policy: the leader
    after each request, and each eviction's victims."""
    rng = random.Random(seed)
    p = SmallMiniatures(1024)
    leaders = []
    evictions = []
    for _ in range(600):
        base = rng.randrange(200) * 1000
        batch = [key(base + i) for i in range(rng.randrange(1, 24))]
        access(p, batch, evictions)
        p.order_chain(batch)
        leaders.append(p.leader)
    return leaders, evictions


def test_a_thinned_replay_makes_the_same_choices_every_time():
    assert SmallMiniatures(1024).selector.sample == 16
    first = replay(seed=37)
    assert first[1], "the stream must evict"
    assert replay(seed=37) == first
