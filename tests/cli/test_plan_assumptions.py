"""`dynmo plan` says what it assumes (issue 36, small lies): without --microbatches it
assumed one micro-batch silently, and then recommended collapsing 4 -> 1 stages at x1.000."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dynmo(*argv: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("dynmo")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(script), *argv], env=env, capture_output=True, text=True, timeout=300)


def test_plan_repack_says_it_assumes_one_microbatch_and_the_answer_changes_with_more(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps([1, 2, 3, 4, 5, 6, 7, 8]))
    base = ["plan", str(costs), "--current-layout", "Ett|tt|tt|ttL", "--repack"]
    assumed = _dynmo(*base)
    assert assumed.returncode == 0, assumed.stderr
    notes = [x for x in assumed.stderr.splitlines() if x.strip()]
    assert len(notes) == 1 and notes[0].startswith("dynmo plan: note: assuming 1 micro-batch"), notes
    assert "--microbatches M" in notes[0]
    told = _dynmo(*base, "--microbatches", "16")
    assert told.returncode == 0 and told.stderr.strip() == "", told.stderr
    assert "4 -> 1 stages" in assumed.stdout and "4 -> 1 stages" not in told.stdout
    as_json = _dynmo(*base, "--json")  # stdout stays one JSON document; the note is on stderr
    assert json.loads(as_json.stdout)["stages_before"] == 4 and "assuming 1" in as_json.stderr


def test_plan_repack_prints_seconds_only_when_the_costs_are_seconds(tmp_path):
    """A costs file's numbers have no unit; with --tokens-per-iteration they are seconds
    (the README's contract), and only then does the plan say "s"."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps([1, 2, 3, 4, 5, 6, 7, 8]))
    base = ["plan", str(costs), "--current-layout", "Ett|tt|tt|ttL", "--repack", "--microbatches", "16"]
    unitless, seconds = _dynmo(*base), _dynmo(*base, "--tokens-per-iteration", "4096")
    assert unitless.returncode == 0 and seconds.returncode == 0, (unitless.stderr, seconds.stderr)
    current = [x for x in unitless.stdout.splitlines() if x.startswith("current:")]
    assert len(current) == 1 and " s," not in current[0], current
    assert "iter s" not in unitless.stdout and "iter" in unitless.stdout
    (timed,) = [x for x in seconds.stdout.splitlines() if x.startswith("current:")]
    assert " s," in timed and "iter s" in seconds.stdout, seconds.stdout
