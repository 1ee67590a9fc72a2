"""config.fields' value checks against what their own messages promise, and every
setting's default against its own check: a check that accepts what its message refuses
(or the reverse) lets a bad value through with no line naming it."""
from __future__ import annotations

import dataclasses
import re

import pytest

from dynmo_plugin.config import DynmoConfig, RunConfig
from dynmo_plugin.config.fields import (ascending_lengths, below_one, fraction, multiple_of_8,
                                        non_negative, positive, zeros_and_ones)

GRID = [-2, -1, -0.5, -1e-9, 0, 1e-9, 0.5, 0.999, 1, 1.000001, 1.5, 2, 8, 100]


def _interval(message: str):
    """'a number in [0, 1)' -> the predicate that interval states, read from the text."""
    lo_br, lo, hi, hi_br = re.fullmatch(r"a number in ([\[(])(\S+), (\S+)([\])])", message).groups()
    lo, hi = float(lo), float(hi)
    return lambda v: (v >= lo if lo_br == "[" else v > lo) and (v <= hi if hi_br == "]" else v < hi)


@pytest.mark.parametrize("check", [fraction, below_one])
def test_interval_checks_accept_exactly_their_stated_interval(check):
    inside = _interval(check(-1))                  # the message of a refused value
    for v in GRID:
        assert (check(v) is None) == inside(v), v


@pytest.mark.parametrize("check,accepts", [
    (positive, lambda v: v > 0), (non_negative, lambda v: v >= 0),
])
def test_sign_checks(check, accepts):
    for v in GRID:
        assert (check(v) is None) == accepts(v), v


def test_multiple_of_8():
    assert [v for v in (-8, 0, 4, 8, 12, 16, 128, 8.0, True) if multiple_of_8(v) is None] == [8, 16, 128]


@pytest.mark.parametrize("value,ok", [
    ("", True), ("1", True), ("1,0", True), (" 1, 0,0", True), ("0,1,1", True),
    ("0", False), ("0,0", False), ("1,2", False), ("1,,0", False), ("yes", False),
])
def test_zeros_and_ones(value, ok):
    assert (zeros_and_ones(value) is None) == ok


@pytest.mark.parametrize("value,ok", [
    ("", True), ("1024", True), ("1024,1536", True), (" 8, 16", True),
    ("1536,1024", False), ("8,8", False), ("0,8", False), ("-8,8", False), ("8,x", False),
])
def test_ascending_lengths(value, ok):
    assert (ascending_lengths(value) is None) == ok


def _sections(obj):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value)
        else:
            yield f, value


@pytest.mark.parametrize("config", [RunConfig, DynmoConfig])
def test_every_default_passes_its_own_check(config):
    checked = 0
    for f, value in _sections(config()):
        check = f.metadata.get("check")
        if check is not None and value is not None:
            assert check(value) is None, (f.name, value, check(value))
            checked += 1
    assert checked >= 10
