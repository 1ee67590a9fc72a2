"""`dynmo simulate` end to end, through the dispatcher, in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120)


SMALL = ["--layers", "16", "--dp", "2", "--pp", "4", "--iterations", "3000"]


def test_json_has_static_dynmo_speedup_and_gpus_when_repacking():
    r = _simulate("--scenario", "freezing", *SMALL, "--balancer", "exact", "--repack", "--json",
                  "--no-output-layer")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for side in ("static", "dynmo"):
        assert out[side]["tokens_per_s"] > 0 and 0 <= out[side]["idleness"] < 1
    assert out["speedup"] > 0 and 0 < out["gpus_avg"] <= 8


def test_text_output_names_the_figures():
    r = _simulate("--scenario", "moe", *SMALL, "--balancer", "uniform")
    assert r.returncode == 0, r.stderr
    for needle in ("tokens/s", "idleness", "speedup", "balancing overhead assumed"):
        assert needle in r.stdout
    assert "GPUs used" not in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--scenario", "nope", *SMALL], "unknown scenario"),
    (["--scenario", "moe", "--layers", "8", "--dp", "2", "--pp", "16"], "larger than the number of layers"),
    (["--scenario", "moe", *SMALL, "--balancer", "bogus"], "unknown balancer"),
    (["--scenario", "moe", *SMALL, "--rebalance-every", "0"], "--rebalance-every"),
    (["--scenario", "moe", "--layers", "8", "--dp", "0", "--pp", "2"], "dp"),
    (["--scenario", "moe", *SMALL, "--seed", "-1"], "--seed must be an integer >= 0"),
    (["--scenario", "moe", *SMALL, "--noise", "nan"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--noise", "inf"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--noise", "-0.1"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--microbatches", "0"], "--microbatches"),
    (["--scenario", "moe", *SMALL, "--iterations", "0"], "--iterations"),
    (["--scenario", "moe", "--layers", "0", "--dp", "1", "--pp", "1"], "--layers"),
    (["--scenario", "moe", "--layers", "8", "--dp", "1" + "0" * 310, "--pp", "2"], "--dp"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = _simulate(*args)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_parameters_balancer_gets_a_message_for_this_command():
    """`plan` takes a costs.json with 'params'; `simulate` does not, so don't suggest it."""
    r = _simulate("--scenario", "moe", *SMALL, "--balancer", "parameters")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--balancer parameters" in r.stderr and "costs.json" not in r.stderr
    assert "exact" in r.stderr and "partition" in r.stderr

