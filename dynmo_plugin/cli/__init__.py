"""The `dynmo` command: one sub-command per module in this package.

Each sub-command module exposes `add_parser(subparsers)` (registers itself and sets
`func`) and a `run(args) -> int`. User errors (`UserError`) and argparse's own (a
non-integer --stages, a missing argument, an unknown flag) become one line on stderr naming
the sub-command, and exit status 2. Stdout holds the result only (with --json, one JSON document): the
work runs inside `_output.third_party_output_to_stderr()`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from dynmo_plugin.config.flags import OneLineParser
from dynmo_plugin.errors import USER_ERROR_EXIT, UserError

__all__ = ["main"]

_SUBCOMMANDS = ("plan", "simulate", "report", "cluster")


class _CommandParser(OneLineParser):
    every_process = True  # one process: say it even where RANK is set (inside a training pod)


def build_parser() -> argparse.ArgumentParser:
    """The `dynmo` parser; it and every sub-command's (the class is inherited) report a
    usage error in one line, without the usage block."""
    parser = _CommandParser(prog="dynmo", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser,
                                       metavar="{" + ",".join(_SUBCOMMANDS) + "}")  # not "command"
    for name in _SUBCOMMANDS:
        importlib.import_module(f"dynmo_plugin.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command = _leaf_parser(parser, args)  # `dynmo cluster release`'s parser for it
    if unknown:  # argparse would blame the top-level `dynmo`; name the sub-command
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"{command.prog}: error: {_one_line(str(e))}", file=sys.stderr)
        return USER_ERROR_EXIT


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost sub-command parser `args` went through (`dynmo cluster release`'s)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen is None:
            return parser
        parser = sub.choices[chosen]


def _one_line(message: str) -> str:
    """The message on one line: scripts and tests read exactly one line of stderr, and a
    message may quote user text (a file name, a layout string) holding newlines."""
    return " ".join(message.split()) or "invalid input"


if __name__ == "__main__":
    sys.exit(main())
