"""`dynmo plan --repack`: the readable and JSON outputs, the options, and one clear
line with exit 2 for every bad input (the planner itself: tests/balancing/test_repack_*)."""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import RepackPlan
from dynmo_plugin.cli import main

# 8 layers on 4 stages, all once cost 3; then 6 of them got 3x cheaper.
SHRUNK = [1, 1, 1, 1, 1, 1, 3, 3]


# ---- dynmo plan --repack ------------------------------------------------------------------------
def _costs_file(tmp_path, doc=None) -> str:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc if doc is not None else {"costs": SHRUNK, "memory": [1] * 8}))
    return str(path)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_cli_repack_readable(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", _costs_file(tmp_path),
                          "--current-layout", "Ett|tt|tt|ttL", "--microbatches", "8", "--repack",
                          "--min-stages", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("repack (dynmo): 4 -> 2 stages")
    assert "decision: REPACK" in out.stdout


def test_cli_repack_json_is_one_document(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", _costs_file(tmp_path),
                          "--current-layout", "Ett|tt|tt|ttL", "--microbatches", "8", "--repack",
                          "--max-slowdown", "2", "--objective", "min_stages", "--json",
                          "--gate-iterations", "1000", "--bandwidth", "1GB"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["apply"] and plan["stages_after"] == 1 and plan["layout_after"] == "EttttttttL"
    assert plan["intermediate_layout"] == "Etttttttt|||L"
    assert RepackPlan.from_dict(plan).stages_after == 1


def test_cli_repack_options(tmp_path):
    costs = _costs_file(tmp_path)
    code, out, _ = _cli("plan", "--costs", costs, "--stages", "4", "--microbatches", "8", "--repack",
                        "--objective", "throughput_per_gpu", "--max-slowdown", "2", "--json")
    assert code == 0 and json.loads(out)["stages_after"] == 1  # uniform current split assumed
    capped = ("--current-layout", "Ett|tt|tt|ttL", "--repack", "--capacity", "3", "--memory-margin",
              "0", "--max-slowdown", "4", "--rebuild-s", "0", "--microbatches", "8")
    # 3 x 3 stages fit 3 bytes; each layer's whole byte is state (move_bytes = memory), so
    # survivor 0 would hold its 3 layers twice while rebuilding: 6 bytes
    code, out, _ = _cli("plan", costs, *capped)
    assert code == 0 and "keep 4 stages" in out
    assert out.splitlines()[-1].startswith("decision: keep - refused for rebuild memory: K = 3 "
                                           "(Ettt|ttt|ttL) qualifies, but the rebuild needs 6 B on rank 0")
    # with 0.4 of each byte state the rebuild fits (2.4 bytes), the migration does not
    light = _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * 8, "move_bytes": [0.4] * 8})
    code, out, _ = _cli("plan", light, *capped)
    assert code == 0 and "keep 4 stages" in out and "migration needs 4 B on stage 1" in out
    code, out, _ = _cli("plan", costs, "--stages", "2", "--method", "exact")  # the positional file
    assert code == 0 and out.startswith("plan (exact)")


@pytest.mark.parametrize("args, message", [
    (["--repack", "--min-stages", "0"], "--min-stages must be an integer between 1"),
    (["--repack", "--max-slowdown", "0"], "--max-slowdown must be a finite number > 0"),
    (["--repack", "--max-slowdown", "nan"], "--max-slowdown"),
    (["--repack", "--memory-margin", "-1"], "--memory-margin"),
    (["--repack", "--rebuild-s", "inf"], "--rebuild-s"),
    (["--repack", "--method", "diffusion"], "exact solver"),
    (["--repack", "--max-rounds", "3"], "--max-rounds"),
    (["--min-stages", "2", "--method", "exact"], "--min-stages only applies with --repack"),
    ([], "--method is required"),
    (["--repack", "--current-layout", "Et|tL"], "has 2 stages but --stages is 4"),
])
def test_cli_repack_bad_input_is_one_line_exit_2(tmp_path, args, message):
    code, out, err = _cli("plan", _costs_file(tmp_path), "--stages", "4", *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and err.startswith("dynmo plan: error:"), err


def test_cli_needs_one_costs_file_and_a_stage_count(tmp_path):
    costs = _costs_file(tmp_path)
    for argv, message in ((["--repack", "--stages", "4"], "no costs file"),
                          ([costs, "--costs", costs + "x", "--repack", "--stages", "4"], "two costs files"),
                          ([costs, "--repack"], "give --stages or --current-layout")):
        code, _, err = _cli("plan", *argv)
        assert code == 2 and message in err and err.count("\n") == 1, err


_FLAG_VALUES = {
    "--min-stages": st.sampled_from(["1", "2", "3", "0", "-1", "x", "99999999"]),
    "--max-slowdown": st.sampled_from(["1", "1.5", "0", "-1", "nan", "inf", "x"]),
    "--objective": st.sampled_from(["min_stages", "throughput_per_gpu", "bogus"]),
    "--memory-margin": st.sampled_from(["0", "0.1", "-0.5", "nan"]),
    "--rebuild-s": st.sampled_from(["0", "10", "-1", "inf"]),
    "--capacity": st.sampled_from(["2", "4", "8", "1e9", "0"]),
    "--gate-iterations": st.sampled_from(["0", "10", "100000"]),
    "--stages": st.sampled_from(["1", "2", "4", "9", "0"]),
    "--current-layout": st.sampled_from(["Ett|tt|tt|ttL", "EttttttttL", "Et|tL", "E|ttttttt|tL"]),
    "--microbatches": st.sampled_from(["1", "4", "0"]),
}


# Values outside the range each flag states (dynmo plan --help, cli/plan.py): whatever else
# is given, the command must refuse them (exit 2). The rest may plan or be refused for how
# they combine (a layout of other layers, a cap no split fits): either outcome is checked
# for its form only.
_OUT_OF_RANGE = {
    "--min-stages": {"0", "-1", "x", "99999999"},          # an integer in [1, 100000]
    "--max-slowdown": {"0", "-1", "nan", "inf", "x"},      # finite, > 0
    "--objective": {"bogus"},
    "--memory-margin": {"-0.5", "nan"},                    # finite, >= 0
    "--rebuild-s": {"-1", "inf"},                          # finite, >= 0
    "--capacity": {"0"},                                   # a positive byte count
    "--stages": {"0"},                                     # an integer >= 1
    "--microbatches": {"0"},                               # an integer >= 1
}


@pytest.mark.parametrize("flag, value", sorted((f, v) for f, bad in _OUT_OF_RANGE.items() for v in bad))
def test_cli_repack_refuses_each_out_of_range_value_alone(tmp_path, flag, value):
    """Each value of the fuzzer's out-of-range table, among flags that plan otherwise: exit
    2 (the fuzzer draws them mixed with others, some never alone)."""
    argv = {"--stages": "4", flag: value}
    code, out, err = _cli("plan", _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * len(SHRUNK)}),
                          "--repack", *itertools.chain(*argv.items()))
    assert code == 2 and out == "", (flag, value, out)
    assert _cli("plan", _costs_file(tmp_path, {"costs": SHRUNK, "memory": [1] * len(SHRUNK)}),
                "--repack", "--stages", "4")[0] == 0


@given(data=st.data())
@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
def test_cli_repack_fuzz(tmp_path, data):
    """Any mix of flags: exit 0 with output (one JSON document with --json), or exit 2
    with one line (a value argparse itself rejects too); exit 2 whenever a value is outside
    its flag's stated range."""
    costs = data.draw(st.sampled_from([SHRUNK, [1, 2], [0, 0, 0, 0], [5]]))
    argv = ["plan", _costs_file(tmp_path, {"costs": costs, "memory": [1] * len(costs)}), "--repack"]
    for flag in data.draw(st.lists(st.sampled_from(sorted(_FLAG_VALUES)), unique=True, max_size=5)):
        argv += [flag, data.draw(_FLAG_VALUES[flag])]
    argv += [f for f in ("--json", "--allow-empty-stages") if data.draw(st.booleans())]
    code, out, err = _cli(*argv)
    assert code in (0, 2), (argv, err)
    flags = dict(zip(argv[3::2], argv[4::2]))
    out_of_range = any(flags.get(flag) in bad for flag, bad in _OUT_OF_RANGE.items())
    assert code == (2 if out_of_range else code), (argv, out)   # either, unless a value is out of range
    if code == 0:
        assert json.loads(out) if "--json" in argv else out.strip()
    else:
        assert err.count("\n") == 1 and err.startswith("dynmo plan: error:") and out == "", err
