"""scenarios.shapes: sizes rounded to the granularity, never past the full size."""
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
