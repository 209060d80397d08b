"""bench_overlap's paired statistics (benchmarks/paired_stats.py) on fixed numbers, and its pair order."""

import math
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))

# benchmarks/, on sys.path above
from bench_overlap import paired_walls
from paired_stats import median_ratio, paired_ratio, t_quantile

# Student's t, two-sided 95 % (0.975 quantile), from the tables
T_975 = {4: 2.7764, 9: 2.2622, 29: 2.0452, 119: 1.9801}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-3)


def test_a_constant_ratio_has_no_spread():
    # every pair 1.1x: the ratio is 1.1 and the interval collapses onto it
    ratio = paired_ratio([1.1, 2.2, 3.3], [1.0, 2.0, 3.0])
    assert ratio.ratio == pytest.approx(1.1)
    assert ratio.low == pytest.approx(1.1)
    assert ratio.high == pytest.approx(1.1)
    assert ratio.num_pairs == 3


def test_the_interval_is_t_on_the_log_ratios():
    numer = [1.10, 1.02, 0.97, 1.05, 1.08]
    denom = [1.00, 1.00, 1.00, 1.00, 1.00]
    logs = [math.log(x) for x in numer]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    # 5 pairs: 4 degrees of freedom
    half = T_975[4] * sd / math.sqrt(5)
    ratio = paired_ratio(numer, denom)
    # the geometric mean of the per-pair ratios, not the ratio of means
    assert ratio.ratio == pytest.approx(math.exp(mean))
    assert ratio.low == pytest.approx(math.exp(mean - half), rel=1e-4)
    assert ratio.high == pytest.approx(math.exp(mean + half), rel=1e-4)


def test_the_ratio_does_not_depend_on_each_pairs_scale():
    # a slow pair (the machine busy for both sides) weighs as much as a fast one
    ratio = paired_ratio([1.2, 12.0], [1.0, 10.0])
    assert ratio.ratio == pytest.approx(1.2)


def test_one_pair_has_no_interval():
    ratio = paired_ratio([1.2], [1.0])
    assert ratio.ratio == pytest.approx(1.2)
    assert math.isnan(ratio.low)
    assert math.isnan(ratio.high)


def test_unpaired_lists_are_refused():
    with pytest.raises(ValueError):
        paired_ratio([1.0, 1.0], [1.0])


def order_of(names: list[str], num_pairs: int) -> list[list[str]]:
    """Which engine served first, second... in each pair (the engines are bare names)."""
    served: list[tuple[int, str]] = []

    def serve(name, llm, k):
        served.append((k, name))
        return 1.0

    walls = paired_walls({name: None for name in names}, num_pairs, serve)
    assert all(len(ws) == num_pairs for ws in walls.values())
    return [[name for k, name in served if k == pair] for pair in range(num_pairs)]


def test_two_engines_alternate_their_order():
    assert order_of(["none", "sync"], 4) == [
        ["none", "sync"],
        ["sync", "none"],
        ["none", "sync"],
        ["sync", "none"],
    ]


def test_three_engines_each_precede_each_other_in_half_the_pairs():
    orders = order_of(["none", "async", "sync"], 6)
    for first, second in [("none", "sync"), ("none", "async"), ("async", "sync")]:
        before = [order.index(first) < order.index(second) for order in orders]
        assert before.count(True) == 3


def test_the_median_ratio_takes_its_bounds_from_the_order_statistics():
    # 101 pairs at ratios 1.00, 1.01, ... 2.00 (shuffled: the order of pairs does not matter)
    numer = [1.0 + i / 100 for i in range(101)]
    numer = numer[50:] + numer[:50]
    ratio = median_ratio(numer, [1.0] * 101)
    assert ratio.ratio == pytest.approx(1.5)
    # the sign test's 95 % ranks for n = 101: the 41st and 61st of the sorted ratios
    assert ratio.low == pytest.approx(1.4)
    assert ratio.high == pytest.approx(1.6)


def test_one_burst_moves_the_median_ratio_little():
    # nine pairs at 1.02, one where the engine without kvtier was stalled 5x
    numer = [1.02] * 9 + [1.0]
    denom = [1.0] * 9 + [5.0]
    assert median_ratio(numer, denom).ratio == pytest.approx(1.02)
    assert paired_ratio(numer, denom).ratio < 0.9
