"""Every flag the launcher and `dynmo simulate` accept is named in the docs.

The flags come from the parsers themselves (`dynmo_plugin.train.build_parser()`, which
generates the `--dynmo-*` and model flags from config/schema.py's fields, and the `dynmo`
parser's `simulate` sub-command), so a flag added to the schema or to cli/simulate.py
without a line in docs/*.md or README.md fails here. A flag counts only as a whole word:
`--dynmo-repack` inside `--dynmo-repack-freed` does not name `--dynmo-repack`.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _docs_text() -> str:
    paths = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths)


def _long_options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def _simulate_parser() -> argparse.ArgumentParser:
    from dynmo_plugin.cli import build_parser
    subs = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return subs[0].choices["simulate"]


def _undocumented(flags: set[str], text: str) -> list[str]:
    return sorted(f for f in flags if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", text))


def test_every_launcher_flag_is_documented():
    from dynmo_plugin.train import build_parser
    flags = _long_options(build_parser())
    # the parser yields what --help prints, the schema's generated flags included
    assert {"--num-layers", "--data-path", "--dynmo", "--dynmo-profile-retime-every",
            "--dynmo-repack-freed", "--dynmo-dynamism", "--dynmo-moe-ep-model"} <= flags
    missing = _undocumented(flags, _docs_text())
    assert not missing, f"flags of dynmo-train named in no docs/*.md or README.md: {', '.join(missing)}"


def test_every_simulate_flag_is_documented():
    flags = _long_options(_simulate_parser())
    assert {"--scenario", "--iterations", "--noise", "--rebalance-every", "--pruning-granularity"} <= flags
    missing = _undocumented(flags, _docs_text())
    assert not missing, f"flags of dynmo simulate named in no docs/*.md or README.md: {', '.join(missing)}"


def test_a_flag_counts_only_as_a_whole_word():
    text = "`--dynmo-repack-freed grow`, `--no-output-layer`, (`--seed`)"
    assert _undocumented({"--dynmo-repack", "--dynmo-repack-freed", "--output", "--seed"}, text) == [
        "--dynmo-repack", "--output"]
