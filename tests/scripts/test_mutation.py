"""scripts/mutation.py reads cosmic-ray's session as cosmic-ray writes it: the session is
written here by cosmic-ray's own WorkDB (the pinned 8.4.6 stores its outcomes by enum
name; the script compared with the values and counted every survivor as killed)."""
import importlib.util
import os
import shlex
import subprocess
import sys
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
    assert mutation._baseline(*args, budget_bound=True) == "budget ran out during the unmutated run"
    assert (slow, None) not in mutation._BASELINES
    assert mutation._baseline(*args) == "tests run past 0 s unmutated"
    assert mutation._BASELINES[(slow, None)] == "tests run past 0 s unmutated"
    assert mutation._baseline("-c pass", "-c pass", None, tmp_path, dict(os.environ), 30) == ""
