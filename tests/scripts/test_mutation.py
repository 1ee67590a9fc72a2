"""scripts/mutation.py reads cosmic-ray's session as cosmic-ray writes it: the session is
written here by cosmic-ray's own WorkDB (the pinned 8.4.6 stores its outcomes by enum
name; the script compared with the values and counted every survivor as killed)."""
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

cosmic_ray = pytest.importorskip("cosmic_ray", reason="the mutation extra is not installed")
from cosmic_ray.work_db import WorkDB, use_db  # noqa: E402
from cosmic_ray.work_item import (MutationSpec, TestOutcome, WorkerOutcome, WorkItem,  # noqa: E402
                                  WorkResult)

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts/mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_outcomes_are_counted_as_cosmic_ray_stores_them(tmp_path):
    mutation = _script()
    db = tmp_path / "s.sqlite"
    outcomes = {"a": (TestOutcome.SURVIVED, "1 passed"), "b": (TestOutcome.KILLED, "1 failed"),
                "c": (TestOutcome.KILLED, "timeout"), "d": (TestOutcome.INCOMPETENT, "trace"),
                "e": None}
    with use_db(str(db), WorkDB.Mode.create) as work:
        for n, job in enumerate(outcomes):
            work.add_work_item(WorkItem(job, [MutationSpec(
                "m.py", "core/NumberReplacer", n, (n + 1, 0), (n + 1, 1), definition_name="f")]))
        for job, done in outcomes.items():
            if done:
                work.set_result(job, WorkResult(WorkerOutcome.NORMAL, done[1], done[0], "-x\n+y"))
    result = mutation.ModuleResult("m")
    mutation._collect(db, result)
    assert (result.survived, result.killed, result.timeout, result.incompetent, result.not_run) == \
        (1, 1, 1, 1, 1)
    assert result.survivors == [{"operator": "NumberReplacer", "line": 1, "function": "f",
                                 "diff": "-x\n+y"}]
    assert result.survival == 0.5


def test_every_target_names_test_files_that_exist():
    """A test path a target names but the tree lacks is dropped without a word (so that
    --ref works on older commits): a typo there would measure a module with fewer tests."""
    mutation = _script()
    missing = [(module, word) for module, tests in mutation.TARGETS.items()
               for word in shlex.split(tests) if word.startswith("tests/")
               and not (ROOT / word.split("::")[0]).exists()]
    assert missing == []


def test_a_quoted_marker_stays_one_argument_and_named_files_run_first(tmp_path):
    """`-m 'not multiproc'` (the unit tests beside a module's live tests) reaches pytest as
    one argument in the baseline and in cosmic-ray's command (both split it with shlex);
    a test file naming the module runs before the rest of its directory."""
    mutation = _script()
    (tmp_path / "tests/balancing").mkdir(parents=True)
    (tmp_path / "tests/megatron").mkdir()
    (tmp_path / "tests/megatron/test_memory_calibration.py").write_text("")
    (tmp_path / "tests/balancing/test_a.py").write_text("")
    (tmp_path / "tests/balancing/test_z.py").write_text("from dynmo_plugin.balancing.memory import calibrate")
    command = mutation._first_related("balancing.memory", mutation.TARGETS["balancing.memory"], tmp_path)
    words = shlex.split(command)
    assert words[words.index("-m", 2) + 1] == "not multiproc"
    assert [w for w in words if w.startswith("tests/")] == [
        "tests/balancing/test_z.py", "tests/megatron/test_memory_calibration.py", "tests/balancing"]
    toml = mutation._config("balancing.memory", command, 60)
    assert f'test-command = "{sys.executable} {command}"' in toml and '"' not in command


def test_the_pytest_plugin_turns_shrinking_off_for_the_tests_own_settings(tmp_path):
    """A killed mutant's failing example is not shrunk (minutes on the balancing
    properties, past --mutant-timeout): the plugin every target's pytest loads takes the
    shrink phase out of the profile that the tests' settings(...) inherit from."""
    mutation = _script()
    (tmp_path / "_mutation_no_shrink.py").write_text(mutation._NO_SHRINK)
    (tmp_path / "_mutation_order.py").write_text((ROOT / "scripts/mutation_order.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "from hypothesis import Phase, settings\n"
        "def test_phases():\n"
        "    assert Phase.shrink not in settings(max_examples=5, derandomize=True).phases\n")
    assert "-p _mutation_no_shrink" in mutation.PYTEST
    run = subprocess.run([sys.executable, *shlex.split(mutation.PYTEST), "test_x.py"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_baseline_cut_by_the_budget_is_not_a_verdict_on_the_tests(tmp_path):
    """The unmutated run stopped because the budget ran out says so, and is not remembered
    for the modules sharing the command; one past --mutant-timeout is the tests' fault."""
    mutation = _script()
    slow = "-c 'import time; time.sleep(30)'"
    args = (slow, slow, None, tmp_path, dict(os.environ), 0.5)
    assert mutation._baseline(*args, budget_bound=True).why == "budget ran out during the unmutated run"
    assert (slow, None) not in mutation._BASELINES
    assert mutation._baseline(*args).why == "tests run past 0 s unmutated"
    assert mutation._BASELINES[(slow, None)].why == "tests run past 0 s unmutated"
    assert mutation._baseline("-c pass", "-c pass", None, tmp_path, dict(os.environ), 30).why == ""


def _toy(tmp_path, mutation):
    """A tree with one target module, its tests and the two plugins, as _copy_tree lays them
    out: `clamp` is covered by test_clamp only; test_other never runs it."""
    (tmp_path / "dynmo_plugin").mkdir()
    (tmp_path / "dynmo_plugin/__init__.py").write_text("")
    (tmp_path / "dynmo_plugin/toy.py").write_text(
        "def clamp(x, lo, hi):\n"
        "    if x < lo:\n"
        "        return lo\n"
        "    return min(x, hi)\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_toy.py").write_text(
        "from dynmo_plugin.toy import clamp\n\n"
        "def test_other():\n"
        "    assert 1 + 1 == 2\n\n"
        "def test_clamp():\n"
        "    assert [clamp(x, 0, 3) for x in (-2, 0, 2, 3, 5)] == [0, 0, 2, 3, 3]\n")
    (tmp_path / "_mutation_no_shrink.py").write_text(mutation._NO_SHRINK)
    (tmp_path / "_mutation_order.py").write_text((ROOT / "scripts/mutation_order.py").read_text())
    return {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}


def test_the_unmutated_run_says_which_tests_cover_which_lines(tmp_path, monkeypatch):
    """The traced baseline maps each line of the target to the tests that ran it (and only
    those): a mutant there is tried on them first."""
    mutation = _script()
    monkeypatch.setattr(mutation, "TARGETS", {"toy": ""})
    env = _toy(tmp_path, mutation)
    tests = f"{mutation.PYTEST} tests/test_toy.py"
    base = mutation._baseline(tests, tests, "toy-trace", tmp_path, env, 120)
    assert base.why == ""
    toy = "dynmo_plugin/toy.py"
    assert {row: ids for (name, row), ids in base.covering.items() if name == toy} == {
        row: ["tests/test_toy.py::test_clamp"] for row in (1, 2, 3, 4)}
    assert set(base.limits) == {"tests/test_toy.py::test_other", "tests/test_toy.py::test_clamp"}
    assert all(limit >= 10 for limit in base.limits.values())


def test_a_mutants_covering_tests_run_first_and_a_hung_test_stops_at_its_limit(tmp_path):
    """The order plugin puts the listed node ids first (the rest keep their order) and gives
    each test its own limit: a test past it fails with pytest-timeout's message, which
    the script counts as a timeout."""
    mutation = _script()
    env = _toy(tmp_path, mutation)
    (tmp_path / "tests/test_toy.py").write_text(
        (tmp_path / "tests/test_toy.py").read_text()
        + "\ndef test_hangs():\n    import time\n    time.sleep(60)\n")
    plan = tmp_path / "first.json"
    plan.write_text(json.dumps({"first": ["tests/test_toy.py::test_hangs", "tests/test_toy.py::test_clamp"],
                                "limits": {"tests/test_toy.py::test_hangs": 1}}))
    run = subprocess.run([sys.executable, *shlex.split(mutation.PYTEST.replace("-x -q", "-v")),
                          "tests/test_toy.py"], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "DYNMO_MUTATION_FIRST": str(plan)}, timeout=50)
    ran = [line.split(" ")[0] for line in run.stdout.splitlines()
           if line.startswith("tests/") and line.split(" ")[1:2] in (["PASSED"], ["FAILED"])]
    assert ran == ["tests/test_toy.py::test_hangs", "tests/test_toy.py::test_clamp",
                   "tests/test_toy.py::test_other"], run.stdout
    assert run.returncode == 1 and mutation._PER_TEST_TIMEOUT in run.stdout


def test_the_scripts_mutant_loop_gives_cosmic_rays_own_outcomes(tmp_path, monkeypatch):
    """Every mutant of the toy run by the script's loop (covering tests first, per-test
    limits) and by `cosmic-ray exec` (the command as given): the same killed and survived
    mutants, so the order changes only when a kill is found."""
    mutation = _script()
    monkeypatch.setattr(mutation, "TARGETS", {"toy": ""})
    env = _toy(tmp_path, mutation)
    tests = f"{mutation.PYTEST} tests/test_toy.py"
    base = mutation._baseline(tests, tests, "toy-exec", tmp_path, env, 120)
    (tmp_path / "cr.toml").write_text(mutation._config("toy", tests, 120))
    cr = [sys.executable, "-m", "cosmic_ray.cli"]
    subprocess.run([*cr, "init", "cr.toml", "ours.sqlite"], cwd=tmp_path, env=env, check=True)
    _, sampled = mutation._sample(tmp_path / "ours.sqlite", 6, 0)
    (tmp_path / "theirs.sqlite").write_bytes((tmp_path / "ours.sqlite").read_bytes())
    seconds: list[float] = []
    assert mutation._exec(tmp_path, tmp_path / "ours.sqlite", tests, env, base, 120,
                          time.monotonic() + 600, seconds)
    subprocess.run([*cr, "exec", "cr.toml", "theirs.sqlite"], cwd=tmp_path, env=env, check=True)
    ours, theirs = mutation.ModuleResult("toy"), mutation.ModuleResult("toy")
    mutation._collect(tmp_path / "ours.sqlite", ours)
    mutation._collect(tmp_path / "theirs.sqlite", theirs)
    assert len(seconds) == sampled == 6
    assert (ours.killed, ours.survived, ours.timeout, ours.not_run) == \
        (theirs.killed, theirs.survived, theirs.timeout, theirs.not_run)
    assert ours.killed > 0 and ours.not_run == 0
    assert sorted(s["diff"] for s in ours.survivors) == sorted(s["diff"] for s in theirs.survivors)
    assert (tmp_path / "dynmo_plugin/toy.py").read_text().startswith("def clamp(x, lo, hi):\n    if x < lo")


def test_commands_shared_by_modules_are_interleaved_so_workers_start_on_different_ones():
    mutation = _script()
    order = mutation.submission_order(sorted(mutation.TARGETS))
    assert sorted(order) == sorted(mutation.TARGETS)
    assert mutation.TARGETS[order[0]] != mutation.TARGETS[order[1]]
    assert order[0].startswith("balancing.")      # the largest group, whose baseline is longest
