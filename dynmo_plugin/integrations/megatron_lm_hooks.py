"""The Megatron-LM integration's process state and its error type.

Megatron-LM keeps its args, timers and writers as process globals; the integration keeps
the functions it wraps and the run they drive the same way (`hooks`). They live here, not
in `megatron_lm`, because the spec module Megatron-LM imports through `--spec`
(`megatron_lm_specs`) reads the plugin's config from them while `megatron_lm` imports that
spec module: with the state in either of the two, they would import each other.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from dynmo_plugin.config import RunConfig
from dynmo_plugin.errors import UserError

__all__ = ["MegatronLMError", "hooks"]


class MegatronLMError(UserError):
    """Megatron-LM is missing, of a version this integration does not know, or configured
    in a way the plugin cannot follow."""


class _Hooks:
    """The wrapped functions' originals and the run they drive (one per process)."""

    def __init__(self):
        self.originals: dict[str, Callable] = {}
        self.compile_helpers: Optional[Callable] = None
        self.cfg: Optional[RunConfig] = None
        self.run: Optional[Any] = None  # megatron_lm._Run while a train() runs


hooks = _Hooks()
