"""Command-line flags generated from the schema's dataclasses.

Every leaf field is one flag: the model's under Megatron-LM's own spelling and dest
(`--num-layers` -> `args.num_layers`, so Megatron-LM's parsed `args` work as they are),
the plugin's under the field's `flag` with dest `dynmo__<section>__<key>`. Every flag
defaults to None, so `config.load` can tell a flag given from one left out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from dynmo_plugin.config.schema import DynmoConfig, ModelArgs

__all__ = ["add_model_args", "add_dynmo_args", "flag_of", "leaf_fields", "OneLineParser"]


def flag_of(f: dataclasses.Field) -> str:
    """The flag that sets field `f`: its metadata's, else --<field-name>."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def leaf_fields(cls, prefix=""):
    """(dotted key, field, argparse dest) for every leaf setting of a config dataclass."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            yield from leaf_fields(f.default_factory, f"{prefix}{f.name}.")
        elif cls is ModelArgs:  # Megatron-LM's own dest names: its `args` works as is
            yield f"{prefix}{f.name}", f, f.name
        else:
            yield f"{prefix}{f.name}", f, "dynmo__" + f"{prefix}{f.name}".replace(".", "__")


def _with_default(f: dataclasses.Field) -> str | None:
    """The field's help with its default, as --help shows it (every flag's argparse
    default is None, so that `config.load` can tell a flag given from one left out)."""
    text = f.metadata.get("help")
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return text
    if default is None or default is False or default == {} or text is None:
        return text
    shown = f"'{default}'" if default == "" else f"{default:g}" if isinstance(default, float) else default
    return f"{text} (default: {shown})"


class OneLineParser(argparse.ArgumentParser):
    """argparse as Megatron-LM configures it (no abbreviations: `--num-layer 6` is not
    --num-layers), with a usage error in one line instead of the whole usage (103 lines),
    printed by rank 0 only (every rank of a run parses the same flags; `every_process`:
    a command that runs once, such as `dynmo`, where RANK may be set by the pod it runs in)."""

    every_process = False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if self.every_process or os.environ.get("RANK", "0") in ("0", ""):
            self._print_message(f"{self.prog}: error: {message} (`{self.prog} --help` lists the "
                                "flags)\n", sys.stderr)
        self.exit(2)


def _add_fields(parser: argparse.ArgumentParser, cls, title: str) -> None:
    group = parser.add_argument_group(title)
    for key, f, dest in leaf_fields(cls):
        kw: dict[str, Any] = {"dest": dest, "default": None, "help": _with_default(f)}
        base = f.type.replace("Optional[", "").rstrip("]")
        if base == "bool":
            kw["action"] = "store_true"
        else:
            kw["metavar"] = key.rsplit(".", 1)[-1].upper()
            kw["type"] = {"int": int, "float": float}.get(base, str)
        group.add_argument(flag_of(f), **kw)


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM-spelled model/run flags (the launcher only)."""
    from dynmo_plugin.config.megatron_flags import add_megatron_compat_args
    _add_fields(parser, ModelArgs, "model (Megatron-LM flags)")
    add_megatron_compat_args(parser)
    return parser


def add_dynmo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags; usable as Megatron-LM's `extra_args_provider`."""
    parser.add_argument("--dynmo-config", default=None, metavar="PATH",
                        help="YAML file with the plugin's settings (flags win over it)")
    _add_fields(parser, DynmoConfig, "dynmo_plugin")
    return parser
