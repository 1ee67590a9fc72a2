"""scenarios.shapes: sizes rounded to the granularity, never past the full size."""
import pytest
from hypothesis import given, strategies as st

from dynmo_plugin.scenarios.shapes import round_nearest, round_up


def test_examples():
    assert round_nearest(2703, 128, hi=8192) == 2688
    assert round_nearest(2760, 128, hi=8192) == 2816
    assert round_nearest(3, 128, hi=8192) == 128          # never reduced to nothing
    assert round_nearest(8190, 128, hi=8190) == 8190      # the full size is allowed
    assert round_up(257, 64, hi=1000) == 320
    assert round_up(990, 64, hi=1000) == 1000


@given(st.integers(0, 10_000), st.integers(1, 256), st.integers(1, 10_000))
def test_properties(n, multiple, hi):
    up, near = round_up(n, multiple, hi), round_nearest(n, multiple, hi)
    for v in (up, near):
        assert v <= hi and (v % multiple == 0 or v == hi)
    assert up >= min(n, hi)
    assert up - min(n, hi) < multiple
    assert near >= min(multiple, hi)


def _multiples(multiple, hi):
    """Every size allowed: the multiples of `multiple` up to `hi`, and `hi` itself."""
    return sorted({*range(0, hi + 1, multiple), hi})


@given(st.integers(-1200, 1200).map(lambda k: k / 4),   # counts and fractions of a count
       st.integers(1, 64), st.integers(0, 200))                 # (not 5e-324: n / 2 underflows)
def test_against_every_allowed_size(n, multiple, hi):
    """By enumeration, not by formula: round_up is the least allowed size >= n (0 for a
    negative n: a count never goes below nothing); round_nearest the multiple nearest n
    (ties to the larger), then held within [one granule, hi]."""
    sizes = _multiples(multiple, hi)
    assert round_up(n, multiple, hi) == min([v for v in sizes if v >= n] or [hi])
    candidates = range(-multiple * 6, 400, multiple)      # every multiple near [-300, 300]
    nearest = min(candidates, key=lambda v: (abs(v - n), -v))
    assert round_nearest(n, multiple, hi) == max(min(hi, multiple), min(hi, nearest))
    assert round_nearest(85, 64, 100) == 64               # the nearest multiple, not hi


def test_a_granularity_below_one_or_a_negative_limit_is_refused():
    for call in (round_up, round_nearest):
        for multiple, hi in ((0, 8), (-8, 8), (8, -1)):
            with pytest.raises(ValueError, match="granularity"):
                call(5, multiple, hi)
