"""`dynmo simulate`: bad input gives one line naming the problem and exit 2; what it
cites exists (issue 28)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "8", "--dp", "1", "--pp", "2", "--iterations", "2000"]


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _one_line_exit_2(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == "", r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "list indices" not in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("content, why", [
    ("[1, 2]", "found list"),
    ('"h100"', "found str"),
    ('{"name": "x", "source": "y"}', "found keys"),
    ('{"name": "x", "source": "y", "shapes": [[1]]}', "shapes are not a list of objects"),
    ('{"name": "x", "source": "y", "shapes": {"a": 1}}', "shapes are not a list of objects"),
])
def test_a_hardware_file_that_is_not_a_profile_is_one_line(tmp_path, content, why):
    path = tmp_path / "hw.json"
    path.write_text(content)
    r = _simulate("--scenario", "mod", *SMALL, "--hardware", str(path))
    _one_line_exit_2(r, "is not a profile", "name, source and shapes", why)


@pytest.mark.parametrize("scenario", ["freezing", "moe", "mod", "early_exit", "sparse_attention"])
def test_pruning_granularity_outside_pruning_is_refused(scenario):
    r = _simulate("--scenario", scenario, *SMALL, "--pruning-granularity", "structured")
    _one_line_exit_2(r, "--pruning-granularity applies only to --scenario gradual_pruning", scenario)


def test_pruning_granularity_with_pruning_still_runs():
    r = _simulate("--scenario", "pruning", *SMALL, "--pruning-granularity", "structured", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["speedup"] > 0


def test_the_h100_profile_cites_a_file_in_the_repository():
    r = _simulate("--scenario", "mod", *SMALL, "--hardware", "h100", "--json")
    assert r.returncode == 0, r.stderr
    source = json.loads(r.stdout)["cost_model"]["source"]
    cited = re.findall(r"[\w./-]+\.md", source)
    assert cited, source
    for path in cited:
        assert (ROOT / path).is_file(), f"{path} is cited but not in the repository"
    assert "### Measured on an H100" in (ROOT / cited[0]).read_text()


@pytest.mark.parametrize("extra, message", [
    (["--costs-from", "/nonexistent", "--hidden", "2048"],
     "--costs-from takes the model shape from the run; drop --hidden"),
    (["--seq-length", "0"], "--seq-length must be an integer between 1"),
    (["--hidden", "1000"], "hidden (1000) must be divisible by heads (32)"),
    (["--hardware", "h100", "--hidden", "2048"], "has no curves for hidden 2048"),
])
def test_shape_flags_are_checked(extra, message):
    _one_line_exit_2(_simulate("--scenario", "mod", *SMALL, *extra), message)
