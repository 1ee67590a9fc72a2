"""The plugin's flags in Megatron-LM's parser: the --dynmo* flags of `dynmo_plugin.config`
plus --dynmo-output, chained after the caller's own `extra_args_provider` (never
replacing it) by the initialize_megatron wrapper (`megatron_lm_wrappers`).
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from dynmo_plugin.config import add_dynmo_args

__all__ = ["add_args", "chain_flags"]


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags for Megatron-LM's parser (what enable() chains in): the --dynmo*
    flags of dynmo_plugin.config plus where the report goes."""
    add_dynmo_args(parser)
    parser.add_argument("--dynmo-output", default="runs/latest", metavar="DIR",
                        help="directory for the plugin's report.json / report.jsonl "
                             "(written by global rank 0)")
    return parser


def chain_flags(user_provider: Optional[Callable]) -> Callable:
    """The caller's extra_args_provider, then the plugin's flags (unless it added them)."""
    def provider(parser):
        if user_provider is not None:
            parser = user_provider(parser)
        if "--dynmo" not in parser._option_string_actions:
            add_args(parser)
        return parser
    provider.dynmo_chained = True
    return provider
