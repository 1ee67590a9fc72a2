"""`dynmo report RUN_DIR`: plots and a Markdown summary of a training run."""
from __future__ import annotations

import argparse
import json

from dynmo_plugin.cli._output import third_party_output_to_stderr
from dynmo_plugin.errors import UserError

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="render plots and a Markdown summary of a run",
                              description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="training --output directory (holds report.json), "
                   "or its report.json or report.jsonl")
    p.add_argument("--out", default=None, help="where to write the PNGs and summary.md "
                   "(default: RUN_DIR)")
    p.add_argument("--json", action="store_true", help='print {"written": [paths]} as one JSON document')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynmo_plugin.reporting import render_report

    with third_party_output_to_stderr():
        try:
            written = render_report(args.run_dir, args.out)
        except OSError as e:  # a full disk or a read-only --out, while writing the files
            where = args.out if args.out is not None else args.run_dir
            raise UserError(f"cannot write the report into {where!r}: {e.strerror or e}; "
                            "pass a writable directory with --out") from e
    if args.json:
        print(json.dumps({"written": [str(path) for path in written]}))
    else:
        for path in written:
            print(path)
    return 0
