"""scripts/mutation.py reads cosmic-ray's session as cosmic-ray writes it: the session is
written here by cosmic-ray's own WorkDB (the pinned 8.4.6 stores its outcomes by enum
name; the script compared with the values and counted every survivor as killed)."""
import importlib.util
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
