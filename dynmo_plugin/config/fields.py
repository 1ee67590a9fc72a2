"""One setting's metadata and its value checks, below every config dataclass.

A field's metadata (`opt`) carries its help text, the flag that sets it and a check: a
function that returns None when the value is fine, else what was expected ("a positive
number"); `config.load` turns that into one `ConfigError` line naming where the value
came from. Pure: standard library only.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from dynmo_plugin.errors import UserError

__all__ = ["ConfigError", "opt", "positive", "non_negative", "one_of", "fraction", "below_one",
           "zeros_and_ones", "ascending_lengths"]


class ConfigError(UserError):
    """A configuration value that cannot be used; the message says where and why."""


def opt(help: str, flag: str | None = None, check: Callable | None = None, **kw) -> dict:
    """Field metadata: `flag` defaults to --<field-name> for model args (`flags.flag_of`)."""
    return {"help": help, "flag": flag, "check": check, **kw}


def positive(v: Any) -> Optional[str]:
    return None if v > 0 else "a positive number"


def layer_count(v: Any) -> Optional[str]:
    """Decoder layers: each is a Python module and a character of the layout string, so
    a count past layouts' bound (2**20, `layout._MAX_EXPANDED`) ran workers out of memory
    building them (2**62 layers: MemoryError on every rank)."""
    return None if 0 < v <= 1 << 20 else "a positive number of at most 1048576 (2**20) layers"


def multiple_of_8(v: Any) -> Optional[str]:
    """A width granularity a bf16 GEMM runs fast at: its fast kernels need every dimension
    a multiple of 8 (16 bytes)."""
    ok = isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % 8 == 0
    return None if ok else "a positive multiple of 8 (e.g. 128; GEMM dimensions must be multiples of 8)"


def non_negative(v: Any) -> Optional[str]:
    return None if v >= 0 else "a non-negative number"


def one_of(*choices: str) -> Callable[[Any], Optional[str]]:
    return lambda v: None if v in choices else f"one of {', '.join(choices)}"


def fraction(v: Any) -> Optional[str]:
    return None if 0 <= v <= 1 else "a number in [0, 1]"


def below_one(v: Any) -> Optional[str]:
    return None if 0 <= v < 1 else "a number in [0, 1)"


def zeros_and_ones(v: Any) -> Optional[str]:
    ok = all(x.strip() in ("0", "1") for x in v.split(",")) and "1" in v
    return None if not v or ok else "comma-separated 0s and 1s with at least one 1, e.g. '1,1,0,0'"


def ascending_lengths(v: Any) -> Optional[str]:
    try:
        xs = [int(x) for x in v.split(",")] if v.strip() else []
    except ValueError:
        xs = None
    ok = xs is not None and xs == sorted(set(xs)) and all(x > 0 for x in xs)
    return None if ok else "ascending positive lengths separated by commas, e.g. '1024,1536'"
