"""`dynmo report RUN_DIR`: plots and a Markdown summary of a training run."""
from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="render plots and a Markdown summary of a run",
                              description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", help="training --output directory (holds report.json)")
    p.add_argument("--out", default=None, help="where to write the PNGs and summary.md "
                   "(default: RUN_DIR)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynmo_plugin.reporting import render_report

    for path in render_report(args.run_dir, args.out):
        print(path)
    return 0
