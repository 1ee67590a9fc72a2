"""Mutation testing of the core: how many deliberate bugs do the tests catch?

cosmic-ray (pinned in setup.cfg's `mutation` extra) changes one thing in one module — a
`<` into `<=`, a `+` into `-`, a number, an `and` into `or`, a loop that never runs — and
runs the tests that cover that module. A mutant the tests still pass ("survived") is a
bug they would miss: kill it with a test, or name why it changes nothing (an equivalent
mutant) in docs/testing.md.

Each target module is mutated in its own copy of the tracked tree (cosmic-ray edits
files on disk), `--jobs` copies at a time. A module has thousands of possible mutants;
a seeded random `--sample` of each, from the operators that leave a program that still
runs (bit-shifts of floats only raise TypeError and teach nothing), fits the
`--budget-s` on this 2-core machine. Mutants left when the budget runs out are reported
as not run, never as killed.

Where the seconds go, and what keeps them down (docs/testing.md, "Wave 8"): the unmutated
run of each test command, once, traced (scripts/mutation_order.py: which tests run which
lines of the targets); then per mutant, cosmic-ray's own mutation applied and the command
run with the tests that run the mutated line first, fastest first, `-x`: a kill costs a
pytest start and a few tests, a survivor still runs every test. Each test may take three
times its traced time plus 10 s, the whole command twice the traced run plus 30 s: a hang
costs that, counted apart as a timeout.

    .venv/bin/pip install -c constraints.txt -e '.[mutation]'
    nice -n 10 .venv/bin/python scripts/mutation.py          # every target, 18-min budget (see docs/testing.md)
    .venv/bin/python scripts/mutation.py --only balancing.gate --sample 10 --json

How long depends on the machine's load more than on the code: docs/testing.md has the
measured times, the survival per module before and after issue 40, and the survivors
left with why.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# -p: the plugins written into each copy: _NO_SHRINK turns hypothesis's shrinking off;
# scripts/mutation_order.py records which tests run which target lines (the unmutated run)
# and runs a mutant's covering tests first, fastest first (each mutant's run)
PYTEST = "-m pytest -x -q -p no:cacheprovider -p _mutation_no_shrink -p _mutation_order"
FAST = f"{PYTEST} --noconftest"           # pure tests need no torchrun launcher
BALANCING = "tests/balancing"
# the unit tests of a balancing module that live beside its live (torchrun) tests
_PURE = "-m 'not multiproc'"
_ALSO = {"memory": f"{_PURE} tests/megatron/test_memory_calibration.py",
         "grow": f"{_PURE} tests/sim/test_sim_freed.py tests/megatron/test_grow_dp.py"}
# module (under dynmo_plugin/) -> the tests that cover it
TARGETS: dict[str, str] = {
    **{f"balancing.{m}": f"{FAST} {_ALSO.get(m, '')} {BALANCING}".replace("  ", " ") for m in (
        "exact", "partition", "diffusion", "segments", "problem", "gate", "memory",
        "metrics", "baselines", "decide", "solve", "grow", "plan")},
    "layout": f"{FAST} tests/test_layout.py tests/config/test_config_layout.py {BALANCING}",
    **{f"config.{m}": f"{FAST} tests/config/test_config.py tests/config/test_config_input.py "
       "tests/config/test_config_layout.py tests/config/test_granularity.py tests/config/test_fields.py "
       "tests/config/test_config_checks_reference.py tests/config/test_layout_mtp.py "
       "tests/data/test_data_documents.py::test_config_checks"   # the data section's checks
       for m in ("checks", "fields", "load", "schema")},
    # three real gloo ranks driving every call (tests/test_consensus.py, ~25 s); the hung and
    # dead peers of tests/run/test_reliability.py train real models: past any budget here
    "consensus": f"{FAST} tests/test_consensus.py "
                 "tests/megatron/test_nccl_safety.py::test_control_plane_refuses_non_cpu_payloads_on_every_rank",
    # the element-by-element reference and MoD's full masked layer; the live MoD and
    # early-exit runs (torchrun) cost minutes per surviving mutant
    "scenarios.gathered_tokens": f"{FAST} {_PURE} tests/scenarios/test_gathered_tokens.py "
                                 "tests/scenarios/test_scenario_mod.py",
    "scenarios.shapes": f"{FAST} tests/scenarios/test_shapes.py",
}
# Operators whose mutants still run: arithmetic among + - * / //, every comparison,
# boolean and unary flips, constants, loops and exception handlers.
_ARITH = ("Add", "Sub", "Mul", "Div", "FloorDiv")
OPERATORS = {f"core/ReplaceBinaryOperator_{a}_{b}" for a in _ARITH for b in _ARITH if a != b} | {
    "core/NumberReplacer", "core/AddNot", "core/ReplaceUnaryOperator_Delete_Not",
    "core/ReplaceUnaryOperator_Delete_USub", "core/ReplaceUnaryOperator_USub_UAdd",
    "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue", "core/ReplaceAndWithOr",
    "core/ReplaceOrWithAnd", "core/ReplaceBreakWithContinue", "core/ReplaceContinueWithBreak",
    "core/ZeroIterationForLoop", "core/ExceptionReplacer"}
_COMPARE = ("Eq", "NotEq", "Lt", "LtE", "Gt", "GtE", "Is", "IsNot", "In", "NotIn")


def _operator_ok(name: str) -> bool:
    return name in OPERATORS or name.startswith("core/ReplaceComparisonOperator_") and all(
        part in _COMPARE for part in name.rsplit("_", 2)[-2:])


@dataclass
class ModuleResult:
    module: str
    mutants: int = 0          # operators kept, before sampling
    sampled: int = 0
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    not_run: int = 0
    incompetent: int = 0
    seconds: float = 0.0
    baseline_s: float = 0.0   # the command's unmutated (traced) run, wherever it ran
    timeout_s: float = 0.0    # per mutant, from the baseline
    mutant_s: list[float] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)
    error: str = ""

    @property
    def survival(self) -> float | None:
        done = self.killed + self.survived
        return self.survived / done if done else None


# A mutant that fails a property test is killed at its first failing example; shrinking
# that example (minutes on the balancing properties) only makes the kill late enough to
# count as a timeout. The tests' own settings(...) take `phases` from this profile.
_NO_SHRINK = (
    '"""scripts/mutation.py\'s pytest plugin: hypothesis without its shrink phase."""\n'
    "from hypothesis import Phase, settings\n\n"
    'settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])\n'
    'settings.load_profile("mutation")\n')


def _copy_tree(dest: Path, ref: str | None) -> None:
    """The tracked files as they are now, or as committed at `ref` (to compare commits);
    plus the two plugins. Untracked files are not copied: `git add` a new test first."""
    (dest / "_mutation_no_shrink.py").write_text(_NO_SHRINK)
    shutil.copyfile(Path(__file__).with_name("mutation_order.py"), dest / "_mutation_order.py")
    if ref:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        return
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src, dst = ROOT / rel.decode(), dest / rel.decode()
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())


def _first_related(module: str, tests: str, tree: Path) -> str:
    """The test files that name the module, first: `-x` then stops at the first kill sooner
    (a survivor runs them all either way). Read from `tree`, the copy under test: with
    --ref, a test file named here may not exist yet there, and is left out."""
    words = [w for w in shlex.split(tests)
             if not w.startswith("tests/") or (tree / w.split("::")[0]).exists()]
    paths = [w for w in words if w.startswith("tests/")]
    named = sorted(str(p.relative_to(tree)) for d in paths if (tree / d).is_dir()
                   for p in (tree / d).glob("test_*.py") if f"dynmo_plugin.{module}" in p.read_text())
    return shlex.join([w for w in words if not w.startswith("tests/")] + named + paths)


@dataclass
class Baseline:
    """The unmutated run of one test command: why it cannot be used ('' when it passed),
    its seconds (traced), and {(file relative to the tree, line): [node ids, fastest first]}."""
    why: str
    seconds: float = 0.0
    covering: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)   # node id -> seconds a mutant may take


_BASELINES: dict[tuple[str, str | None], Baseline] = {}
_BASELINE_LOCKS: dict[tuple[str, str | None], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def _target_files(tree: Path) -> str:
    """Every target's file in `tree`, for the tracer: one traced run serves every module
    that shares the command."""
    return os.pathsep.join(str(tree / ("dynmo_plugin/" + m.replace(".", "/") + ".py")) for m in TARGETS)


def per_test_limit(traced_s: float) -> float:
    """Seconds one test may take under a mutant: three times its traced (so slower)
    unmutated time plus 10 s. A mutant that hangs a test costs that, not the command's
    timeout; one that only slows it by less than ~3x is not a hang."""
    return round(3 * traced_s + 10, 1)


def _covering(trace: Path, tree: Path) -> dict[tuple[str, int], list[str]]:
    """The traced run's {(file relative to tree, line): node ids, fastest test first}."""
    root, tests = os.path.realpath(tree), json.loads(trace.read_text())
    covering: dict[tuple[str, int], list[tuple[float, str]]] = {}
    for nodeid, (seconds, lines) in tests.items():
        for name, rows in lines.items():
            rel = os.path.relpath(name, root)
            for row in rows:
                covering.setdefault((rel, row), []).append((seconds, nodeid))
    return {key: [nodeid for _, nodeid in sorted(ids)] for key, ids in covering.items()}


def _baseline(shared: str, tests: str, ref: str | None, tree: Path, env: dict,
              timeout: float, budget_bound: bool = False) -> Baseline:
    """The unmutated tests in `tree`: `why` is '' when they pass, else why not. Without it a
    test that fails anyway (a missing file at --ref, an environment the commit predates)
    counts every mutant as killed. Once per test command (`shared`, as TARGETS names it,
    before a module's own files are put first) and tree: the balancing modules share theirs,
    and wait for it; other commands run theirs meanwhile. The run is traced (which tests
    cover which target lines, for each mutant's order). `budget_bound`: `timeout` is what is
    left of the budget, so running past it says nothing about the tests (not remembered)."""
    key = (shared, ref)
    with _LOCKS_LOCK:
        lock = _BASELINE_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key in _BASELINES:
            return _BASELINES[key]
        log, trace = tree / "baseline.log", tree / "baseline-trace.json"
        traced = {**env, "DYNMO_MUTATION_TRACE": str(trace), "DYNMO_MUTATION_TRACE_FILES": _target_files(tree)}
        start = time.monotonic()
        code = _run_group([sys.executable, *shlex.split(tests)], tree, traced, timeout, log)
        seconds = time.monotonic() - start
        if code is None and budget_bound:
            return Baseline("budget ran out during the unmutated run", seconds)
        why = (f"tests run past {timeout:.0f} s unmutated" if code is None else "" if code == 0
               else f"tests fail unmutated (exit {code}): "
               + (log.read_text().strip().splitlines() or [""])[-1])
        traced = json.loads(trace.read_text()) if not why and trace.exists() else {}
        _BASELINES[key] = Baseline(why, seconds, _covering(trace, tree) if traced else {},
                                   {nodeid: per_test_limit(s) for nodeid, (s, _) in traced.items()})
        return _BASELINES[key]


def mutant_timeout_for(baseline_s: float, cap: float) -> float:
    """Seconds a mutant's tests may run: twice the (traced, so slower) unmutated run plus
    30 s of start-up and noise, at most `cap`. A mutant that hangs the tests costs that,
    not the cap; one that only slows them by less than 2x is not a hang."""
    return min(cap, 2 * baseline_s + 30)


def _config(module: str, tests: str, timeout: float) -> str:
    path = "dynmo_plugin/" + module.replace(".", "/") + ".py"
    return (f'[cosmic-ray]\nmodule-path = ["{path}"]\ntimeout = {timeout}\nexcluded-modules = []\n'
            f'test-command = "{sys.executable} {tests}"\n[cosmic-ray.distributor]\nname = "local"\n')


def _sample(db: Path, n: int, seed: int) -> tuple[int, int]:
    """Keep `n` mutants of the runnable operators, chosen by `seed`; (kept before, sampled)."""
    con = sqlite3.connect(db)
    rows = con.execute("select job_id, operator_name from mutation_specs order by start_pos_row, "
                       "start_pos_col, operator_name, occurrence").fetchall()   # not job_id: random
    ok = [job for job, op in rows if _operator_ok(op)]
    keep = set(random.Random(seed).sample(ok, min(n, len(ok))))
    drop = [(job,) for job, _ in rows if job not in keep]
    con.executemany("delete from mutation_specs where job_id = ?", drop)
    con.executemany("delete from work_items where job_id = ?", drop)
    con.commit()
    con.close()
    return len(ok), len(keep)


_PER_TEST_TIMEOUT = "s) from pytest-timeout."    # pytest-timeout's failure at a test's limit


def _first(covering: dict[tuple[str, int], list[str]], spec) -> list[str]:
    """The node ids that run any line of the mutant, fastest first."""
    rel = str(spec.module_path)
    ids: dict[str, None] = {}
    for row in range(spec.start_pos[0], spec.end_pos[0] + 1):
        ids.update(dict.fromkeys(covering.get((rel, row), ())))
    return list(ids)


def _exec(tree: Path, db: Path, tests: str, env: dict, base: Baseline, timeout: float,
          deadline: float, seconds: list[float]) -> bool:
    """Run each sampled mutant of the session `db` (cosmic-ray's own mutation, its outcomes
    stored as `cosmic-ray exec` stores them), covering tests first; False if the budget ran
    out (the mutants left stay not run). Our loop, not `exec`: the order differs per mutant."""
    from cosmic_ray.mutating import _make_diff, use_mutation
    from cosmic_ray.plugins import get_operator
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    cmd = [sys.executable, *shlex.split(tests)]
    with use_db(str(db), WorkDB.Mode.open) as work:
        for item in list(work.pending_work_items):
            left = deadline - time.monotonic()
            if left <= 1:
                return False
            spec = item.mutations[0]
            path = tree / spec.module_path
            first = tree / "first.json"
            first.write_text(json.dumps({"first": _first(base.covering, spec), "limits": base.limits}))
            start = time.monotonic()
            with use_mutation(path, get_operator(spec.operator_name)(**spec.operator_args),
                              spec.occurrence) as (original, mutated):
                if mutated is None:
                    work.set_result(item.job_id, WorkResult(worker_outcome=WorkerOutcome.NO_TEST))
                    continue
                for pyc in (path.parent / "__pycache__").glob(path.stem + ".*.pyc"):
                    pyc.unlink()    # never a stale compile of another mutant (same size, same second)
                log = tree / "mutant.log"
                code = _run_group(cmd, tree, {**env, "DYNMO_MUTATION_FIRST": str(first)},
                                  min(timeout, left), log)
            seconds.append(round(time.monotonic() - start, 1))
            if code is None and left < timeout:
                return False
            outcome = TestOutcome.SURVIVED if code == 0 else TestOutcome.KILLED
            output = log.read_text()[-4000:] if code is not None else ""
            if code is None or _PER_TEST_TIMEOUT in output:
                output = "timeout"      # as cosmic-ray writes a timeout: counted apart
            work.set_result(item.job_id, WorkResult(
                output=output, test_outcome=outcome, worker_outcome=WorkerOutcome.NORMAL,
                diff="\n".join(_make_diff(original, mutated, spec.module_path))))
    return True


def _collect(db: Path, result: ModuleResult) -> None:
    """Count the session's outcomes. cosmic-ray stores its enums by name ('SURVIVED',
    'KILLED', 'INCOMPETENT'), and a test command past the timeout as KILLED with the
    output 'timeout'."""
    con = sqlite3.connect(db)
    rows = con.execute(
        "select s.operator_name, s.start_pos_row, s.definition_name, r.test_outcome, "
        "r.output, r.diff from mutation_specs s left join work_results r "
        "on s.job_id = r.job_id").fetchall()
    con.close()
    for op, row, where, outcome, output, diff in rows:
        outcome = (outcome or "").lower()
        if not outcome:
            result.not_run += 1
        elif outcome == "killed" and (output or "").strip() == "timeout":
            result.timeout += 1     # a mutant that hangs the tests is caught, counted apart
        elif outcome == "survived":
            result.survived += 1
            result.survivors.append({"operator": op.removeprefix("core/"), "line": row,
                                     "function": where, "diff": diff or ""})
        elif outcome == "killed":
            result.killed += 1
        else:                       # incompetent: the mutant could not be applied or run
            result.incompetent += 1


def _run_group(cmd: list[str], cwd: Path, env: dict, timeout: float,
               log: Path | None = None) -> int | None:
    """Run `cmd` in its own process group (output to `log`); its exit status, None if it ran
    past `timeout`. The whole group is stopped then (and when this script is interrupted):
    killing cosmic-ray alone leaves its pytest running on, mutated, in a directory about to
    be removed."""
    with open(log or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    _GROUPS.add(proc.pid)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _GROUPS.discard(proc.pid)


_GROUPS: set[int] = set()
_TREES: set[str] = set()      # the copies, removed on a stop too


def _stop(signum: int, _frame) -> None:
    """SIGTERM/SIGINT: stop every running cosmic-ray group, then exit 128+signal."""
    for pgid in list(_GROUPS):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for tree in list(_TREES):
        shutil.rmtree(tree, ignore_errors=True)
    os._exit(128 + signum)


def run_module(module: str, tests: str, sample: int, seed: int, deadline: float,
               mutant_timeout: float, ref: str | None = None) -> ModuleResult:
    result, start = ModuleResult(module), time.monotonic()
    if start >= deadline:
        result.error = "budget ran out before this module"
        return result
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        tree = Path(tmp)
        _TREES.add(tmp)
        _copy_tree(tree, ref)
        if not (tree / 'dynmo_plugin' / (module.replace('.', '/') + '.py')).exists():
            result.error = 'no such module at this commit'
            return result
        shared, tests = tests, _first_related(module, tests, tree)
        # tests/ on the path: --noconftest tests still import its helpers (launch, ...)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests")])}
        left = deadline - time.monotonic()
        base = _baseline(shared, tests, ref, tree, env, max(1.0, min(mutant_timeout, left)),
                         budget_bound=left < mutant_timeout)
        result.error, result.baseline_s = base.why, round(base.seconds, 1)
        if result.error:
            return result
        result.timeout_s = mutant_timeout_for(base.seconds, mutant_timeout)
        (tree / "cr.toml").write_text(_config(module, tests, result.timeout_s))
        cr = [sys.executable, "-m", "cosmic_ray.cli"]
        init = subprocess.run([*cr, "init", "cr.toml", "s.sqlite"], cwd=tree, env=env,
                              capture_output=True, text=True)
        if init.returncode:
            result.error = (init.stderr.strip().splitlines() or ["init failed"])[-1]
            return result
        result.mutants, result.sampled = _sample(tree / "s.sqlite", sample, seed)
        if not _exec(tree, tree / "s.sqlite", tests, env, base, result.timeout_s, deadline,
                     result.mutant_s):
            result.error = "budget ran out"
        _collect(tree / "s.sqlite", result)
        _TREES.discard(tmp)
    result.seconds = time.monotonic() - start
    return result


def submission_order(modules: list[str]) -> list[str]:
    """Modules sharing a test command wait for its one unmutated run: interleave the
    commands (the largest group first) so that `--jobs` workers start on different ones."""
    groups: dict[str, list[str]] = {}
    for m in modules:
        groups.setdefault(TARGETS[m], []).append(m)
    queues = sorted(groups.values(), key=len, reverse=True)
    order: list[str] = []
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    return order


def _table(results: list[ModuleResult]) -> str:
    lines = ["| module | mutants | sampled | killed | survived | timeout | not run | survival | s "
             "| baseline s | mutant s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rate = "–" if r.survival is None else f"{r.survival:.0%}"
        lines.append(f"| {r.module} | {r.mutants} | {r.sampled} | {r.killed} | {r.survived} | "
                     f"{r.timeout} | {r.not_run} | {rate} | {r.seconds:.0f} | {r.baseline_s:.0f} | "
                     f"{' '.join(f'{x:.0f}' for x in r.mutant_s)} |")
    killed, survived = sum(r.killed for r in results), sum(r.survived for r in results)
    total = f"{survived / (killed + survived):.1%}" if killed + survived else "–"
    lines.append(f"\nsurvival over all run mutants: {total} ({survived} of {killed + survived})")
    for r in results:
        for s in r.survivors:
            lines.append(f"- survived: {r.module}:{s['line']} ({s['function']}) {s['operator']}")
        if r.error:
            lines.append(f"- {r.module}: {r.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--budget-s", type=float, default=1080.0, help="wall-clock budget (default %(default)s)")
    ap.add_argument("--sample", type=int, default=4, help="mutants per module; the default fits "
                    "--budget-s for every target on this 2-core machine (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="which mutants are sampled, with the module's "
                    "name: --only X samples X's as a full run does (default %(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="modules mutated at once (default %(default)s)")
    ap.add_argument("--mutant-timeout", type=float, default=300.0, help="at most this many seconds per "
                    "mutant's tests; less where twice the unmutated run plus 30 s is less")
    ap.add_argument("--ref", help="mutate the tree committed at this git ref (default: the working tree)")
    ap.add_argument("--only", nargs="+", choices=sorted(TARGETS), help="these modules only")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        print("mutation: cosmic-ray is not installed; run "
              ".venv/bin/pip install -c constraints.txt -e '.[mutation]'", file=sys.stderr)
        return 2
    modules = args.only or sorted(TARGETS)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    start = time.monotonic()
    deadline = start + args.budget_s
    from cosmic_ray.plugins import get_operator
    get_operator("core/NumberReplacer")     # the operator registry loaded once, not in two threads
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        futures = {m: pool.submit(run_module, m, TARGETS[m], args.sample,
                                  args.seed + zlib.crc32(m.encode()), deadline,
                                  args.mutant_timeout, args.ref) for m in submission_order(modules)}
        for fut in cf.as_completed(futures.values()):
            r = fut.result()
            print(f"mutation: {r.module} done in {r.seconds:.0f} s, {time.monotonic() - start:.0f} s in",
                  file=sys.stderr)
        results = [futures[m].result() for m in modules]
    if args.json:
        print(json.dumps([{**asdict(r), "survival": r.survival} for r in results], indent=1))
    else:
        print(_table(results))
        print(f"wall: {time.monotonic() - start:.0f} s for {len(modules)} modules, --jobs {args.jobs}, "
              f"--sample {args.sample}, --seed {args.seed}, ref {args.ref or 'working tree'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
