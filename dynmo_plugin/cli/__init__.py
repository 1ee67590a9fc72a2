"""The `dynmo` command: one sub-command per module in this package.

Each sub-command module exposes `add_parser(subparsers)` (registers itself and sets
`func`) and a `run(args) -> int`. User errors (`UserError`) become one line on stderr
and exit status 2. Stdout holds the result only (with --json, one JSON document): the
work runs inside `_output.third_party_output_to_stderr()`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from dynmo_plugin.errors import USER_ERROR_EXIT, UserError

__all__ = ["main"]

_SUBCOMMANDS = ("plan", "simulate", "report", "cluster")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dynmo", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"dynmo_plugin.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"dynmo {args.command}: error: {_one_line(str(e))}", file=sys.stderr)
        return USER_ERROR_EXIT


def _one_line(message: str) -> str:
    """The message on one line: scripts and tests read exactly one line of stderr, and a
    message may quote user text (a file name, a layout string) holding newlines."""
    return " ".join(message.split()) or "invalid input"


if __name__ == "__main__":
    sys.exit(main())
