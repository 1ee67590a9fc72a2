"""Fuzz the `dynmo` sub-commands: every input ends in a clean exit 0 or a clean exit 2.

Hypothesis generates malformed inputs (random bytes, non-UTF-8 files, JSON of the wrong
shape or type, NaN / Infinity / negative / boolean / huge values, bad flag values) and
calls `dynmo_plugin.cli.main(argv)` in process. For every input:

* exit 0: stdout holds the result; with --json it is exactly one JSON document
  (`json.loads` of all of stdout succeeds: nothing printed before or after it);
* exit 2 from a `UserError`: exactly one non-empty line on stderr;
* exit 2 from argparse itself (a non-integer --stages, a missing required flag): raised
  as SystemExit(2), also with exactly one line, "dynmo <cmd>: error: ... (`dynmo <cmd>
  --help` lists the flags)", and no usage block;
* nothing else: no other exit code, no uncaught exception.

The last test runs `plan --json` and `simulate --json` as real subprocesses, where a
third-party library printing to stdout (DeepSpeed's accelerator warning) would break
`json.loads`.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dynmo_plugin.cli import main

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_ERROR_LINE = re.compile(r"^dynmo (plan|simulate|report|cluster release): error: \S")


# ---- running the CLI and checking the contract -----------------------------------------
def _run(argv: list[str]) -> tuple[int, str, str, bool]:
    """(exit code, stdout, stderr, whether argparse exited) of `dynmo argv`."""
    out, err = io.StringIO(), io.StringIO()
    argparse_exit = False
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # only argparse exits this way; main() returns codes
            code, argparse_exit = e.code, True
    return code, out.getvalue(), err.getvalue(), argparse_exit


def _check_error(err: str, argparse_exit: bool) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and _ERROR_LINE.match(lines[0]), err
    if argparse_exit:
        assert re.search(r"\(`dynmo [a-z ]+ --help` lists the flags\)$", lines[0]), err
    assert "Traceback" not in err


def _check(argv: list[str]) -> tuple[int, str]:
    """Run `dynmo argv` and assert the contract above; returns (code, stdout)."""
    code, out, err, argparse_exit = _run(argv)
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        _check_error(err, argparse_exit)
    elif "--json" in argv:
        json.loads(out)  # raises unless stdout is exactly one JSON document
    else:
        assert out.strip(), (argv, err)
    return code, out


# ---- generated inputs: mostly well-formed, so that the deep paths run too -------------------
def _mostly(valid: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """`valid` about three times in four, else `odd` (st.one_of would pick evenly)."""
    return st.integers(0, 3).flatmap(lambda k: odd if k == 3 else valid)


_ODD_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, -1, -0.5, True, False, None, "1",
                                1e308, 10**400, 0, 2.5])
_NUMBER = _mostly(st.one_of(st.integers(0, 1000), st.floats(0, 1e6)), _ODD_NUMBERS)
_JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**30) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["costs", "memory", "move_bytes", "params", "cost", "iterations", "events",
                         "x"]) | st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


def _numbers(max_size: int = 6) -> st.SearchStrategy[list]:
    return st.lists(_NUMBER, min_size=1, max_size=max_size)


def _file_bytes(json_docs: st.SearchStrategy) -> st.SearchStrategy[bytes]:
    """Mostly a JSON document (NaN / Infinity tokens included), else random or non-UTF-8 bytes."""
    return _mostly(json_docs.map(lambda doc: json.dumps(doc).encode()),
                   st.one_of(st.binary(max_size=40),
                             st.binary(max_size=20).map(lambda b: b"\xff\xfe" + b)))


_COSTS_DOC = _mostly(
    st.one_of(_numbers(),
              st.fixed_dictionaries({"costs": _numbers()},
                                    optional={"memory": _numbers(), "move_bytes": _numbers(),
                                              "params": _numbers()})),
    st.one_of(_JSON_ANY, st.fixed_dictionaries({"costs": _numbers()}, optional={"extra": _JSON_ANY})))
_EXTRAS_DOC = _mostly(st.one_of(_numbers(4), st.fixed_dictionaries(
    {}, optional={"cost": _numbers(4), "memory": _numbers(4)})), _JSON_ANY)
_INT_TEXT = _mostly(st.integers(1, 4).map(str), st.one_of(
    st.integers(-3, 0).map(str), st.sampled_from(["x", "1.5", "", "99999999999999999999", "1e3", " 2"])))
_FLOAT_TEXT = _mostly(st.floats(0, 5).map(repr),
                      st.sampled_from(["nan", "inf", "-inf", "-1", "1e999", "x"]))
_BYTES_TEXT = _mostly(st.sampled_from(["80GiB", "4e3", "2KB,3KB", " 7 MiB ", "1e6,1e6,1e6,1e6"]),
                      st.sampled_from(["0", "-1", "nan", "1e999", "lots", "1e9,", "1e300TB"]))
_LAYOUT_TEXT = _mostly(st.sampled_from(["Et|tL", "Ett|tL", "Et|t|tL", "Ettt|tttL", "Et*2|t*2L",
                                        "(t|)*3"]),
                       st.sampled_from(["t*99999999999", "E|L", "garbage\nline",
                                        "E(t)*12345678901234|L"]))


def _write(directory: Path, name: str, data: bytes) -> str:
    path = directory / name
    path.write_bytes(data)
    return str(path)


@st.composite
def _plan_argv(draw, directory: Path) -> list[str]:
    """A `dynmo plan` command line; files written into `directory`."""
    argv = ["plan", "--costs", _write(directory, "costs.json", draw(_file_bytes(_COSTS_DOC))),
            "--stages", draw(_INT_TEXT),
            "--method", draw(st.sampled_from(["exact", "diffusion", "uniform", "parameters",
                                              "partition", "bogus"]))]
    optional = {
        "--memory": lambda: _write(directory, "mem.json", draw(_file_bytes(_numbers()))),
        "--extras": lambda: _write(directory, "extras.json", draw(_file_bytes(_EXTRAS_DOC))),
        "--capacity": lambda: draw(_BYTES_TEXT),
        "--current-layout": lambda: draw(_LAYOUT_TEXT),
        "--microbatches": lambda: draw(_INT_TEXT),
        "--max-rounds": lambda: draw(_INT_TEXT),
        "--gate-iterations": lambda: draw(_INT_TEXT),
        "--bandwidth": lambda: draw(_BYTES_TEXT),
        "--margin": lambda: draw(_FLOAT_TEXT),
    }
    for flag in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=4)):
        argv += [flag, optional[flag]()]
    argv += [flag for flag in ("--allow-empty-stages", "--json") if draw(st.booleans())]
    return argv


@given(data=st.data())
@FUZZ
def test_plan_fuzz(data):
    with tempfile.TemporaryDirectory() as tmp:
        _check(data.draw(_plan_argv(Path(tmp))))


@pytest.mark.parametrize("content, flags, code", [
    (b"[1, 2, 3, 4]", ["--json"], 0),
    (b"[1, 2, 3, 4]", ["--method", "partition", "--json"], 0),
    (b"\xff\xfe[1, 2]", [], 2),  # was a UnicodeDecodeError traceback
    (b"[true, false, true]", [], 2),  # was accepted as costs [1, 0, 1]
    (b"[1" + b"0" * 400 + b", 1]", [], 2),  # float() of it overflows
    (b"[" * 100_000 + b"]" * 100_000, [], 2),  # RecursionError in json
    (b"[1, 2, 3]", ["--current-layout", "E(t)*99999999999|L"], 2),  # would expand in memory
    (b"[1, 2, 3]", ["--stages", "99999999999999999999", "--allow-empty-stages", "--capacity", "1"], 2),
    (b"[1e300, 1e300, 1]", ["--microbatches", "1000000000", "--json"], 2),  # Infinity in the JSON
], ids=["ok", "partition", "non-utf8", "booleans", "huge-int", "deep", "repeat", "stages", "overflow"])
def test_known_plan_inputs(content, flags, code):
    """Inputs that once broke `dynmo plan`, through the same contract as the fuzzers."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["plan", "--costs", _write(Path(tmp), "c.json", content), "--stages", "2",
                "--method", "exact", *flags]
        assert _check(argv)[0] == code


# ---- dynmo simulate: tiny sizes, every numeric flag malformed in turn ------------------------
_SIM_FLAGS = {
    "--layers": _mostly(st.integers(2, 6).map(str), st.sampled_from(["0", "-1", "x", "10" * 30])),
    "--dp": _mostly(st.integers(1, 3).map(str), st.sampled_from(["0", "1" + "0" * 310, "2.0"])),
    "--pp": _mostly(st.integers(1, 2).map(str), st.sampled_from(["0", "-1", "99", "x"])),
    "--iterations": _mostly(st.integers(1, 400).map(str), st.sampled_from(["0", "-1", "1e3"])),
    "--microbatches": _mostly(st.integers(1, 4).map(str), st.sampled_from(["0", "10" * 20])),
    "--rebalance-every": _mostly(st.integers(1, 200).map(str), st.sampled_from(["0", "nope"])),
    "--noise": _mostly(st.floats(0, 0.5).map(repr),
                       st.sampled_from(["nan", "inf", "-inf", "-0.1", "1e308", "3"])),
    "--seed": _mostly(st.integers(0, 2**70).map(str), st.sampled_from(["-1", "-2", "1.5"])),
}


@st.composite
def _simulate_argv(draw) -> list[str]:
    scenarios = st.sampled_from(["moe", "freezing", "pruning", "mod", "early_exit",
                                 "sparse_attention"])
    balancers = st.sampled_from(["uniform", "exact", "diffusion", "partition"])
    argv = ["simulate", "--scenario", draw(_mostly(scenarios, st.just("nope"))),
            "--layers", "4", "--dp", "1", "--pp", "2", "--iterations", "300",
            "--balancer", draw(_mostly(balancers, st.sampled_from(["parameters", "bogus"])))]
    for flag in draw(st.lists(st.sampled_from(sorted(_SIM_FLAGS)), unique=True, max_size=3)):
        argv += [flag, draw(_SIM_FLAGS[flag])]  # argparse: the last value of a flag wins
    argv += [flag for flag in ("--repack", "--no-output-layer", "--json") if draw(st.booleans())]
    return argv


_SIM_BASE = ["simulate", "--scenario", "moe", "--layers", "4", "--dp", "1", "--pp", "2",
             "--iterations", "300"]


@given(argv=_simulate_argv())
@example(argv=[*_SIM_BASE, "--seed", "-1"])  # was a numpy traceback
@example(argv=[*_SIM_BASE, "--dp", "1" + "0" * 310])  # was an OverflowError traceback
@example(argv=[*_SIM_BASE, "--noise", "nan", "--json"])
@settings(FUZZ, max_examples=40)
def test_simulate_fuzz(argv):
    _check(argv)


# ---- dynmo report -----------------------------------------------------------------------------
_TIME = _mostly(st.floats(0, 10), _ODD_NUMBERS)
_ITERATION = st.fixed_dictionaries({"iteration": _mostly(st.integers(0, 50), _ODD_NUMBERS)},
                                   optional={"time_s": _TIME, "loss": _TIME})
_EVENT = st.fixed_dictionaries(
    {"kind": st.one_of(st.sampled_from(["rebalance", "repack", "profile", "$\\frac$", "_x"]),
                       st.text(max_size=5))},
    optional={"iteration": _mostly(st.integers(0, 50), _ODD_NUMBERS),
              "stage_loads_before": _numbers(3), "stage_loads_after": _numbers(3),
              "applied": _JSON_ANY, "layout_before": _JSON_ANY, "overhead_s": _JSON_ANY,
              "measured_iter_s_before": _TIME, "moves": _JSON_ANY})
_REPORT_DOC = _mostly(
    st.fixed_dictionaries({"iterations": _mostly(st.lists(_mostly(_ITERATION, _JSON_ANY), min_size=1, max_size=5),
                                                  _JSON_ANY)}, optional={
        "events": _mostly(st.lists(_mostly(_EVENT, _JSON_ANY), max_size=3), _JSON_ANY),
        "gpus": _mostly(st.lists(st.fixed_dictionaries({"iteration": _NUMBER, "gpus": _NUMBER}),
                                 max_size=3), _JSON_ANY),
        "world": _JSON_ANY, "layout": _JSON_ANY, "initial_layout": _JSON_ANY}),
    _JSON_ANY,
)


_MAX_ITER, _MAX_S = 2**53, 1e150   # the report's stated limits (reporting/model.py's docstring)


def _finite(value) -> float | None:
    """A JSON number or numeric string as a finite float; booleans are not numbers. The
    oracle's own reading of the stated rule, on purpose not reporting/model.py's `_num`."""
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def _whole_in(value, low, high) -> bool:
    v = _finite(value)
    return v is not None and v == int(v) and low <= v <= high


def _event_ok(e: dict) -> bool:
    """Whether an event holds only values a run can write (no negative or > 1e150 seconds,
    no negative bytes, a whole iteration >= 0)."""
    it = _finite(e.get("iteration"))
    if it is not None and not _whole_in(it, 0, _MAX_ITER):
        return False
    seconds = []
    for key in ("stage_loads_before", "stage_loads_after"):
        loads = e.get(key)
        if isinstance(loads, list) and all(_finite(v) is not None for v in loads):
            seconds += [_finite(v) for v in loads]
    if isinstance(e.get("overhead_s"), dict):
        seconds += [v for v in map(_finite, e["overhead_s"].values()) if v is not None]
    seconds += [v for v in (_finite(e.get(k)) for k in (
        "measured_iter_s_before", "measured_iter_s_after", "predicted_iter_s_before",
        "predicted_iter_s_after")) if v is not None]
    moves = e.get("moves") if isinstance(e.get("moves"), list) else []
    moved = sum(_finite(m.get("bytes")) or 0.0 for m in moves if isinstance(m, dict))
    return all(0 <= v <= _MAX_S for v in seconds) and moved >= 0


def _report_outcome(content: bytes) -> int:
    """Which exit the report's stated rules give for this report.json: 0 (plots) or 2 (one
    line). The rules: UTF-8 JSON holding an
    object; 'iterations' a list with at least one object with a numeric 'iteration', each
    such iteration whole and >= 0 with 'time_s' absent or a finite duration <= 1e150 s;
    'events' and 'gpus' absent or lists; no event with an impossible number; every 'gpus'
    entry with a numeric count a whole count >= 1 at a whole iteration >= 0."""
    try:
        doc = json.loads(content.decode("utf-8-sig"))
    except (ValueError, RecursionError):   # not UTF-8, not JSON, too deep, too long a number
        return 2
    if not isinstance(doc, dict) or not isinstance(doc.get("iterations"), list):
        return 2
    records = [r for r in doc["iterations"] if isinstance(r, dict) and _finite(r.get("iteration")) is not None]
    if not records or any(not isinstance(doc.get(k), (list, type(None))) for k in ("events", "gpus")):
        return 2
    for r in records:
        if r.get("repeated") is True:
            continue
        t = _finite(r.get("time_s"))
        if not _whole_in(r["iteration"], 0, _MAX_ITER) or (
                r.get("time_s") is not None and (t is None or not 0 <= t <= _MAX_S)):
            return 2
    events = [_event_ok(e) for e in doc.get("events") or [] if isinstance(e, dict)]
    gpus = [g for g in doc.get("gpus") or [] if isinstance(g, dict) and _finite(g.get("gpus")) is not None]
    if not all(events) or not all(
            _whole_in(g.get("iteration"), 0, _MAX_ITER) and _whole_in(g["gpus"], 1, _MAX_ITER) for g in gpus):
        return 2
    return 0


@given(content=_file_bytes(_REPORT_DOC))
@example(content=b"\xff\xfe{}")  # was a UnicodeDecodeError traceback
@example(content=b'{"iterations": [{"iteration": 0, "time_s": 1e308}]}')  # was a matplotlib one
@example(content=b'{"iterations": [{"iteration": 3, "time_s": 0.5}], "gpus": [{"iteration": 1, "gpus": 0}]}')
@example(content=b'{"iterations": [{"iteration": 3}], "events": [{"kind": "x", "overhead_s": {"a": -1}}]}')
@example(content=b'{"iterations": [{"iteration": 3}], "events": [{"kind": "x", "iteration": 2.5}]}')  # was read as 2
@example(content=b'{"iterations": [{"iteration": 3, "loss": NaN}, {"iteration": -1, "repeated": true}]}')
@settings(FUZZ, max_examples=60)
def test_report_fuzz(content):
    """Exit 0 with the plots written, or exit 2 with one line: whichever the report's rules
    say for this file (not merely one of the two)."""
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp), "report.json", content)
        code, out = _check(["report", tmp, "--out", str(Path(tmp) / "out")])
        want = _report_outcome(content)
        assert code == want, (content[:300], code, want)
        assert code == 2 or (out.strip() and all(Path(line).exists() for line in out.splitlines()))


# ---- real subprocesses: third-party prints must not reach stdout -----------------------------
@pytest.mark.parametrize("argv", [
    ["plan", "--costs", "{costs}", "--stages", "2", "--method", "partition", "--json"],
    ["simulate", "--scenario", "moe", "--layers", "4", "--dp", "1", "--pp", "2",
     "--iterations", "3000", "--balancer", "partition", "--json"],
], ids=["plan", "simulate"])
def test_json_stdout_is_one_document_in_a_subprocess(tmp_path, argv):
    costs = tmp_path / "costs.json"
    costs.write_text("[3, 1, 1, 2]")
    argv = [a.replace("{costs}", str(costs)) for a in argv]
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict), r.stdout[:200]


# ---- paths (issue 36): which outcome is right for each kind of path ----------------------------
_PROFILE_EVENT = {"kind": "profile", "iteration": 2, "trigger": "profile_interval", "window": [2, 2],
                  "layout": "Etttt|ttttL", "profile": {
                      "layers": [{"layer": n, "stage": (n - 1) // 4, "fwd_s": 0.01, "bwd_s": 0.02,
                                  "param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1, "act_bytes": 1}
                                 for n in range(1, 9)],
                      "stages": [{"stage": s, "extra_s": [0.005, 0.06][s], "wait_s": 0.0, "peak_bytes": 0,
                                  "num_microbatches": 8} for s in range(2)]}}
_PATH_KINDS = ("missing", "a directory without a report", "not JSON", "a report without a profile",
               "a report of a profile-only run", "under a file")


def _path_of(tmp: Path, kind: str, as_dir: bool) -> str:
    run = tmp / "run"
    blocker = tmp / "a_file"
    blocker.write_text("x")
    if kind == "missing":
        return str(tmp / "nowhere")
    if kind == "under a file":
        return str(blocker / "run")
    run.mkdir()
    if kind == "not JSON":
        (run / "report.json").write_text("{not json")
    elif kind != "a directory without a report":
        events = [_PROFILE_EVENT] if kind == "a report of a profile-only run" else []
        doc = {"config": {"model": {"global_batch_size": 8, "micro_batch_size": 1},
                          "dynmo": {"rebalance": {"memory_cap_gb": 0.0, "allow_empty_stages": False},
                                    "repack": {"enabled": False}}},
               "world": {"dp": 1}, "iterations": [], "events": events}
        (run / "report.json").write_text(json.dumps(doc))
    return str(run) if as_dir else str(run / "report.json")


@given(kind=st.sampled_from(_PATH_KINDS), flag=st.sampled_from(["--from-run", "--from-profile"]))
@settings(FUZZ, max_examples=24)
def test_plan_from_recorded_paths(kind, flag):
    """Exit 0 with a layout exactly for a profile-only run's report (it raised KeyError:
    'layers' or refused "no rebalance profile"); every other path: one line naming the flag."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _path_of(Path(tmp), kind, as_dir=flag == "--from-run")
        code, out = _check(["plan", flag, path])
        _, _, err, _ = _run(["plan", flag, path])
    if kind == "a report of a profile-only run":
        assert code == 0 and "--pipeline-model-parallel-layout 'Ettttt|ttt" in out, (out, err)
    else:
        assert code == 2 and err.startswith(f"dynmo plan: error: {flag} "), err
    if kind == "a report without a profile":
        assert "recorded no profile" in err, err


# ---- usage errors and messages in each sub-command's own flags ---------------------------------
def _one_line_exit_2(argv: list[str]) -> str:
    """The stderr line of `dynmo argv`, asserting exit 2, one line and an empty stdout."""
    code, out, err, _ = _run(argv)
    assert code == 2 and out == "", (argv, code, out)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip() and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, starts", [
    (["plan", "c.json", "--stages", "abc", "--method", "exact", "--json"],
     "dynmo plan: error: argument --stages: invalid int value: 'abc'"),
    (["simulate", "--scenario", "layer_freezing", "--layers", "eight", "--json"],
     "dynmo simulate: error: argument --layers: invalid int value: 'eight'"),
    (["cluster", "release", "--strategy", "bogus", "--namespace", "ml", "--name", "t", "--keep", "1",
      "--json"], "dynmo cluster release: error: argument --strategy: invalid choice: 'bogus'"),
    (["plan", "c.json", "--stages", "2", "--method", "exact", "--bogus", "--json"],
     "dynmo plan: error: unrecognized arguments: --bogus"),  # was blamed on `dynmo`
    (["cluster", "release", "--strategy", "none", "--namespace", "ml", "--name", "t", "--keep", "1",
      "--bogus", "--json"], "dynmo cluster release: error: unrecognized arguments: --bogus"),
    (["plan", "c.json", "--stage", "2", "--method", "exact", "--json"],  # no abbreviations
     "dynmo plan: error: unrecognized arguments: --stage 2"),
    (["report"], "dynmo report: error: the following arguments are required: RUN_DIR"),
    (["cluster"], "dynmo cluster: error: the following arguments are required: {release}"),
    ([], "dynmo: error: the following arguments are required: {plan,simulate,report,cluster}"),
], ids=["int", "simulate-int", "choice", "unknown", "unknown-nested", "abbreviation", "missing",
        "no-action", "no-command"])
def test_usage_errors_are_one_line(argv, starts):
    """argparse's errors: one line naming the sub-command and its --help, no usage block."""
    line = _one_line_exit_2(argv)
    prog = starts.split(": error:")[0]
    assert line.startswith(starts) and line.endswith(f"(`{prog} --help` lists the flags)"), line


def test_usage_errors_are_said_where_rank_is_set(monkeypatch):
    """The launcher's parser speaks on rank 0 only; `dynmo` runs once, also inside a
    training pod whose RANK is not 0, and stayed silent there."""
    monkeypatch.setenv("RANK", "3")
    assert _one_line_exit_2(["plan", "c.json", "--stages", "abc"]).startswith("dynmo plan: error: argument --stages")


@pytest.mark.parametrize("flags, says, launcher_flag", [
    (["--current-layout", "Ett|ttt|L"], "--current-layout 'Ett|ttt|L' holds 5 decoder layers ('t') "
     "but costs file", "--num-layers"),
    (["--current-layout", "Ett|tt|L", "--stages", "2"], "--current-layout 'Ett|tt|L' has 3 stages "
     "but --stages is 2", "--pipeline-model-parallel-size"),
], ids=["layers", "stages"])
def test_plan_layout_mismatch_names_plans_flags(tmp_path, flags, says, launcher_flag):
    """Layout.parse's own messages name the launcher's flags, which plan does not have."""
    costs = _write(tmp_path, "c.json", b"[1, 2, 3, 4]")
    line = _one_line_exit_2(["plan", costs, "--method", "exact", "--json", *flags])
    assert says in line and launcher_flag not in line, line


@pytest.mark.parametrize("flags, says, unknown", [
    (["--freed", "bogus"], 'dynmo simulate: error: --freed must be one of release, grow, auto, '
     'got "bogus"', "error: freed"),
    (["--hidden", "1000000", "--seq-length", "10000000", "--micro-batch", "100000"],
     "lower --hidden, --seq-length or --micro-batch, or raise --pp", "raise the capacity"),
], ids=["freed", "does-not-fit"])
def test_simulate_messages_name_simulates_flags(flags, says, unknown):
    """simulate has --freed but no capacity flag: its messages say so."""
    argv = ["simulate", "--scenario", "layer_freezing", "--layers", "8", "--dp", "1", "--pp", "2",
            "--iterations", "300", "--json", *flags]
    line = _one_line_exit_2(argv)
    assert says in line and unknown not in line, line


def test_report_of_a_finished_runs_log_reads_its_summary(tmp_path, caplog):
    """`dynmo report RUN/report.jsonl` of a finished run: its summary, no warning that
    the run did not finish ("read RUN/report.jsonl instead" of that very file)."""
    from dynmo_plugin.report import LOG_NAME, RunReport

    world = {"pp": 2, "tp": 1, "dp": 1, "world_size": 2,
             "history": [{"iteration": 0, "pp": 2, "tp": 1, "dp": 1, "world_size": 2}]}
    report = RunReport(path=str(tmp_path / "report.json"), config={"model": {"num_layers": 4}},
                       world=world, initial_layout="Ett|ttL")
    for it in range(1, 6):
        report.add_iteration(it, 10.0 - 0.1 * it, 0.2, dynmo_s=0.01)
    report.close()
    code, out, err, _ = _run(["report", str(tmp_path / LOG_NAME), "--out", str(tmp_path / "out"),
                              "--json"])
    assert code == 0, err
    assert not [r for r in caplog.records if "not the final report" in r.getMessage()]
    assert "did not finish" not in (tmp_path / "out" / "summary.md").read_text()
    assert json.loads(out)["written"]
