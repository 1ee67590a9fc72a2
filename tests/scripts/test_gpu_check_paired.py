"""The plugin-overhead verdict's interval (scripts/gpu_checks/paired.py): Wilcoxon's
signed-rank interval around the Hodges-Lehmann estimate, checked against the published
critical values and, exactly, against every sign pattern of small samples."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from test_gpu_check import gpu_check  # noqa: F401 - puts scripts/ on the path

from gpu_checks import paired  # noqa: E402


@pytest.mark.parametrize("n", range(0, 11))
def test_the_null_distribution_counts_every_sign_pattern(n):
    brute = [0] * (n * (n + 1) // 2 + 1)
    for signs in itertools.product((0, 1), repeat=n):
        brute[sum(rank for rank, up in zip(range(1, n + 1), signs) if up)] += 1
    assert paired.signed_rank_counts(n) == brute


def test_the_interval_cuts_the_published_critical_values():
    """Two-sided 5% critical values of Wilcoxon's statistic (T <= c rejects): n=6: 0, 8: 3,
    10: 8, 16: 29, 20: 52; the interval starts at the (c + 1)-th Walsh average; n=5 has none."""
    assert [paired.interval_rank(n, 0.95) - 1 for n in (6, 8, 10, 16, 20)] == [0, 3, 8, 29, 52]
    assert paired.interval_rank(5, 0.95) == 0
    assert paired.interval_rank(6, 1 - 2 / 64) == 1  # P(T <= 0) = 1/64 exactly half the miss allowed: kept
    five = paired.paired_ratio_interval([1.01, 1.02, 0.99, 1.03, 1.0])
    assert five.lo == 0.0 and five.hi == math.inf and five.estimate == pytest.approx(1.01, abs=1e-3)
    assert str(five) == "1.010x (5 pairs: too few for a 95% interval)"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=6, max_size=9, unique=True), st.floats(0.5, 0.99))
def test_over_every_sign_pattern_the_true_ratio_falls_outside_as_often_as_the_confidence_allows(magnitudes, conf):
    """Symmetry about the true ratio (1 here) makes every sign pattern of the pairs' log
    ratios equally likely: counting them gives the interval's exact miss rate, which must be
    2 P(T <= k - 1) and at most 1 - confidence (an index off by one breaks both)."""
    n = len(magnitudes)
    k = paired.interval_rank(n, conf)
    missed = 0
    for signs in itertools.product((-1, 1), repeat=n):
        iv = paired.paired_ratio_interval([math.exp(s * m / 100) for s, m in zip(signs, magnitudes)], conf)
        missed += iv.lo > 1 or iv.hi < 1
    assert missed == 2 * sum(paired.signed_rank_counts(n)[:k])
    assert missed <= (1 - conf) * 2 ** n + 1e-9


def test_the_estimate_is_the_pairs_centre_and_a_stall_moves_it_by_a_rank_not_its_size():
    around = [1.02 * math.exp(s * d) for d in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08) for s in (-1, 1)]
    iv = paired.paired_ratio_interval(around)
    assert iv.estimate == pytest.approx(1.02) and iv.lo < 1.02 < iv.hi and iv.pairs == 16
    stalled = paired.paired_ratio_interval(around[:-1] + [3.0])  # one iteration 3x: a stall
    assert stalled.estimate == pytest.approx(1.02, abs=0.005) and stalled.hi < 1.07
    assert str(iv).startswith("1.020x (95% interval ") and str(iv).endswith(" over 16 pairs)")


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [1.0, -1.0], [float("nan")]])
def test_a_ratio_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match="positive"):
        paired.paired_ratio_interval(bad)


def test_the_estimate_is_the_median_of_the_walsh_averages_not_of_the_pairs():
    """log ratios 0, 1, 5: Walsh averages 0, .5, 1, 2.5, 3, 5, their median 1.75 (the
    pairs' own median is 1)."""
    iv = paired.paired_ratio_interval([1.0, math.e, math.e ** 5])
    assert iv.estimate == pytest.approx(math.exp(1.75))


@pytest.mark.parametrize("lo,hi,passed,said", [(1.0, 1.03, True, "at or under 1.03"),
                                               (1.03, 1.05, True, "not judged"),
                                               (1.0301, 1.05, False, "over 1.03")])
def test_the_bound_itself_passes_and_only_an_interval_wholly_over_it_fails(monkeypatch, lo, hi, passed, said):
    from gpu_checks import rows_mlm
    monkeypatch.setattr(rows_mlm, "paired_ratio_interval", lambda pairs: paired.Interval(lo, 1.03, hi, 28, 0.95))
    ok, how = rows_mlm.overhead_verdict([1.0] * 28)
    assert ok is passed and said in how
