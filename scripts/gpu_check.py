#!/usr/bin/env python
"""The GPU acceptance checks, one verdict table: run by scripts/gpu_check.sh (which
installs what is missing first), or directly with the packages in place.

    python scripts/gpu_check.py [--cpu] [--json] [--out DIR] [--only NAME,...] [--rounds N]
                                [--budget-s S] [--plan]

Checks, each a row `check | result | detail` (result: pass, FAIL or "skipped: why") with
the seconds it took (a run shared by several rows counts for the first), in plan order:
  machine                CUDA GPUs visible (names, torch and CUDA versions)
  packages               megatron-core imports; Transformer Engine imports or why not
  precision_flag         whether the launcher takes --bf16 (else everything runs fp32)
  profile_heavy_layer    PP=1 (bf16 where the launcher has it) with a test layer that
                         runs its forward 3 times: the profile must see it 3x (+-25%)
                         its neighbours' median
  transformer_engine     PP=1 training with --transformer-impl transformer_engine: losses
                         finite, every layer profiled (needs TE)
  bf16_vs_fp32_speed     tokens/s of the same model in fp32 and bf16, side by side; bf16
                         must be the faster
  migration_bitexact[P]  PP=2 (2 GPUs): layers moved at iterations 3 and 5 (forced
                         layouts), losses and final parameters equal to a never-moved run
                         bit for bit, per precision P
  repack_2_to_1          PP=2 -> 1 live repack; equal to a PP=1 run resumed from the
                         PP=2 checkpoint at the repack point (the tied output weight
                         becomes the embedding: see tests/megatron/test_repack.py)
  identical_layers[S]    PP=1 bf16 at shape S (host: 12L h1024 s1024 mb4, host-bound;
                         gpu: 6L h4096 s2048 mb1, GPU-bound), test layers 3 at 3x and 5
                         at 2x: max/min fwd+bwd of the identical others <= 1.10
  heavy_layer[S]         the same run: layer 3 at 3.0x and layer 5 at 2.0x (+-10%) their
                         neighbours' median, and the fit cost = c + k*w with c within
                         +-0.10 of a neighbour (no constant per span)
  profiling_overhead[S]  the same run: profiled iterations / unprofiled ones <= 1.3
  stage_prediction[S]    the same run: each profile's predicted stage time per iteration
                         within 10% of the median iteration outside windows
  identical_layers[mlm-S], stage_prediction[mlm-S]  the same inside Megatron-LM's
                         pretrain_gpt.py ($DYNMO_MEGATRON_LM) with --dynmo profiling
  throughput_vs_megatron_lm  host shape, bf16: the launcher, pretrain_gpt.py and pretrain_gpt.py
                         --dynmo --dynmo-profile-every 20, each started ONCE, take turns on the
                         GPU for --rounds (default 4) interleaved rounds (gpu_checks/host_session.py,
                         a file baton), like for like (no dropout, clipping or NaN checks, weight
                         decay 0.01): launcher/Megatron-LM <= 1.0x; the plugin on/off inside the
                         --dynmo process (bypassed on alternate iterations) <= 1.03x where the
                         95% signed-rank interval over its neighbouring pairs (28) lies on one
                         side of 1.03 (warm-up, each round's first and last iteration and the
                         windows excluded; the rounds' medians and spread printed). The --dynmo run also feeds
                         identical_layers[mlm-host] and stage_prediction[mlm-host]
  scenario_cost[KIND]    each of the six scenarios at PP=1 bf16 at a shape where it
                         should save: the affected layers' cost over the reference's
                         (SCENARIOS below); also written to OUT/scenario_costs.json
                         (docs/gpu.md: the format the simulator reads)
  nccl/...               the rows of scripts/gpu_check_nccl.py --json, where it exists
--only NAME,...: run only the rows whose name (or row group's name) starts with one of
these prefixes (nccl/NAME: gpu_check_nccl.py runs only the rows picked). --set issue34:
issue 34's rows (machine, packages, precision_flag, shape, mlm, throughput): one device
call of ~3-5 minutes by the plan.
--plan: print the launch plan (row groups, their launches, estimated seconds from the
constants in scripts/gpu_check_plan.py) and exit; a run prints it to stderr first.
--budget-s S (default 480, issue 24's 8 minutes): a row group starts only while its
estimate (scaled by what the groups run so far took) fits in what is left; one that does
not is moved behind the cheaper groups still to come, then its rows say "skipped:
budget"; every launch's timeout is capped at what is left. Determinism settings go to
the bit-exact rows' launches only. The one-rank runs go through one launcher worker
(scripts/gpu_check_worker.py: one process, one start-up); gpu_check_nccl.py's children
start at once beside this script's probe, before any timed row (docs/gpu.md, "Budget").
--cpu (what `gpu_check.sh --dry-run` passes): hide any GPU, run what runs on CPU (the
heavy-layer profile on a small model, thread CPU time; gpu_check_nccl.py --cpu), mark
the GPU checks "skipped: no CUDA"; exits 0 when nothing failed. Without --cpu and without CUDA the
machine row fails. Exit status: 1 if any row is FAIL, else 0.
--json: exactly one JSON document on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check_plan import (BATON_TURN_S, BUDGET_S, IT_S, NCCL_LONGEST_ROW_S, SPARSE_CALIBRATION_S,  # noqa: E402
                            START_GROUP, Group, Launch, Plan, Schedule, render_plan)
from gpu_checks import common, launching, rows_basic, rows_mlm, rows_scenarios, rows_shapes  # noqa: E402
from gpu_checks.common import CPU_SIZES, CheckFailed, DETERMINISM_ENV, GPU_SIZES, Machine, NO_CUDA, Row, SKIPPED_BUDGET, Sizes, _log, exit_status, render  # noqa: E402
from gpu_checks.launching import Budget, BudgetExceeded, Worker, _error_line, timed_out, worker_env  # noqa: E402
from gpu_checks.rows_basic import check_machine, check_migration, check_packages, check_precision_flag, check_profile_heavy_layer, check_repack, check_speed, check_transformer_engine, probe_machine  # noqa: E402
from gpu_checks.rows_shapes import Runs, SHAPES, THROUGHPUT_ROUNDS, check_heavy, check_identical, check_overhead, check_prediction  # noqa: E402
from gpu_checks.rows_mlm import MLM_ENV, MLM_ITERS, check_mlm_identical, check_mlm_prediction, check_throughput  # noqa: E402
from gpu_checks.host_session import GPU_SESSION, PROGRAMS as SESSION_PROGRAMS  # noqa: E402
from gpu_checks.rows_scenarios import SCENARIOS, check_scenario, write_scenario_costs  # noqa: E402


def __getattr__(name: str):
    """Every row module's names as attributes of this script, as before the split (the
    tests and other scripts read them here; BUDGET and WORKER live in `launching`)."""
    for module in (common, launching, rows_basic, rows_shapes, rows_mlm, rows_scenarios):
        if name in vars(module):
            return vars(module)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- scripts/gpu_check_nccl.py (the 'nccl' rows) ----------------------------------------------
NCCL_SCRIPT = ROOT / "scripts" / "gpu_check_nccl.py"


def start_nccl(cpu_mode: bool, timeout_s: float = 300, rows: Optional[list[str]] = None) -> Optional[tuple]:
    """Start gpu_check_nccl.py --json (its children's timeouts capped at what is left of
    the budget; `rows`: only these of its rows, named nccl/<check>); None where the script
    does not exist. `collect_nccl` reads its rows."""
    if not NCCL_SCRIPT.exists():
        return None
    _log(f"start {NCCL_SCRIPT.name}")
    limit, by_budget = launching.BUDGET.limit(timeout_s)
    only = ["--only", ",".join(r.split("/", 1)[1] for r in rows)] if rows is not None else []
    cmd = [sys.executable, str(NCCL_SCRIPT), *(["--cpu"] if cpu_mode else []), "--json", *only,
           "--deadline-s", f"{max(1.0, limit - 10):.0f}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, time.perf_counter(), limit, by_budget


def collect_nccl(proc: subprocess.Popen, start: float, limit: float, by_budget: bool) -> list[Row]:
    """The script's rows, each named nccl/<check>; one row 'nccl' when it gave none."""
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, limit - (time.perf_counter() - start)))
        rows = json.loads(stdout)["rows"]
    except subprocess.TimeoutExpired:
        launching.kill_tree(proc)
        launching._drain(proc)
        failed = timed_out(limit, by_budget, NCCL_SCRIPT.name)
        result = SKIPPED_BUDGET if isinstance(failed, BudgetExceeded) else "FAIL"
        return [Row("nccl", result, str(failed), time.perf_counter() - start)]
    except (ValueError, KeyError, TypeError) as e:
        return [Row("nccl", "FAIL", f"{NCCL_SCRIPT.name} gave no JSON rows: {type(e).__name__}: {e}; "
                    f"{_error_line(stderr)}"[:300], time.perf_counter() - start)]
    return [Row(f"nccl/{r['check']}", r["result"], r.get("detail", ""), float(r.get("seconds", 0.0)))
            for r in rows]


def nccl_rows(cpu_mode: bool, timeout_s: float = 300) -> list[Row]:
    """The rows of gpu_check_nccl.py --json (one JSON document {"rows": [...]}), each
    named nccl/<check>; none where the script does not exist."""
    started = start_nccl(cpu_mode, timeout_s)
    return [] if started is None else collect_nccl(*started)


def _guard(name: str, fn: Callable[[], Row]) -> Row:
    start = time.perf_counter()
    try:
        row = fn()
    except BudgetExceeded as e:
        row = Row(name, SKIPPED_BUDGET, str(e))
    except CheckFailed as e:
        row = Row(name, "FAIL", str(e))
    except Exception as e:  # noqa: BLE001 - a broken check is a failed check, with its reason
        row = Row(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    row.seconds = time.perf_counter() - start
    return row


def plan_checks(m: Machine, sizes: Sizes, out: Path, rounds: int = THROUGHPUT_ROUNDS,
                costs: Optional[dict] = None) -> list[tuple[str, Callable[[], Row]]]:
    """Every row, in the order they run (cheap first; shared runs next to each other)."""
    runs, costs = Runs(), costs if costs is not None else {}
    checks: list[tuple[str, Callable[[], Row]]] = [
        ("machine", lambda: check_machine(m, sizes, out)),
        ("packages", lambda: check_packages(m, sizes, out)),
        ("precision_flag", lambda: check_precision_flag(m, sizes, out)),
    ]
    if m.cpu_mode or not m.gpus:  # the per-shape rows replace it on a GPU
        checks.append(("profile_heavy_layer", lambda: check_profile_heavy_layer(m, sizes, out)))
    for shape in SHAPES:
        checks += [(f"identical_layers[{shape}]", lambda s=shape: check_identical(m, s, out, runs)),
                   (f"heavy_layer[{shape}]", lambda s=shape: check_heavy(m, s, out, runs)),
                   (f"profiling_overhead[{shape}]", lambda s=shape: check_overhead(m, s, out, runs)),
                   (f"stage_prediction[{shape}]", lambda s=shape: check_prediction(m, s, out, runs))]
    for shape in SHAPES:
        checks += [(f"identical_layers[mlm-{shape}]", lambda s=shape: check_mlm_identical(m, s, out, runs, rounds)),
                   (f"stage_prediction[mlm-{shape}]", lambda s=shape: check_mlm_prediction(m, s, out, runs, rounds))]
    checks.append(("throughput_vs_megatron_lm", lambda: check_throughput(m, out, runs, rounds)))
    checks += [(f"scenario_cost[{sc.kind}]", lambda sc=sc: check_scenario(m, sc, out, costs))
               for sc in SCENARIOS]
    checks += [
        ("transformer_engine", lambda: check_transformer_engine(m, sizes, out)),
        ("bf16_vs_fp32_speed", lambda: check_speed(m, sizes, out)),
        ("migration_bitexact[fp32]", lambda: check_migration(m, sizes, out, "fp32")),
    ]
    if m.bf16:
        checks.append(("migration_bitexact[bf16]", lambda: check_migration(m, sizes, out, "bf16")))
    checks.append(("repack_2_to_1", lambda: check_repack(m, sizes, out)))
    return checks


# ---- the launch plan (scripts/gpu_check_plan.py: its constants and table) ---------------------
def _w(what: str, iters: int, model: str) -> Launch:
    return Launch(what, "worker", iters, IT_S[model])


def _mlm(what: str, model: str) -> Launch:
    return Launch(f"pretrain_gpt.py {what}, {MLM_ITERS} it.", "torchrun", MLM_ITERS, IT_S[model])


_SCENARIO_MODEL = {"moe": "s8_moe", "sparse_attention": "sparse_s32768", "mixture_of_depths": "s8_mb4"}


def build_plan(m: Machine, rounds: int = THROUGHPUT_ROUNDS, mlm: Optional[bool] = None, budget_s: float = BUDGET_S) -> Plan:
    """The row groups in the order they run, each with the launches it makes on machine
    `m` (with `mlm`: whether $DYNMO_MEGATRON_LM is set). The rows most wanted come first,
    so a run that the budget cuts loses the end."""
    gpus = len(m.gpus)
    mlm = bool(os.environ.get(MLM_ENV)) if mlm is None else mlm
    why = None if gpus else NO_CUDA
    mlm_why = why or (None if mlm else f"skipped: {MLM_ENV} not set")
    two_why = why or (None if gpus >= 2 else "skipped: needs 2 GPUs")
    te_why = why or (None if m.te_problem is None else "skipped: TE not usable")
    on = lambda reason, *launches: {"launches": () if reason else launches, "note": reason or ""}  # noqa: E731
    groups = [start_group(gpus)]
    if not gpus:
        groups.append(Group("profile_heavy_layer", ("profile_heavy_layer",),
                            (_w("4L h512 s64 + 3x layer, CPU", 3, "small"),)))
    for shape, (_, what) in SHAPES.items():
        groups.append(Group(f"shape[{shape}]", tuple(f"{r}[{shape}]" for r in ("identical_layers", "heavy_layer",
                                                                               "profiling_overhead",
                                                                               "stage_prediction")),
                            **on(why, _w(f"{what} + 3x layer", 12, f"{shape}_heavy"))))
    # the host shape's three programs (the launcher, pretrain_gpt.py, pretrain_gpt.py --dynmo)
    # start once, together, then take turns round by round (gpu_checks/host_session.py): the
    # longest start-up counts once, every program's iterations one after another
    groups += [Group("mlm[host]", ("identical_layers[mlm-host]", "stage_prediction[mlm-host]",
                                   "throughput_vs_megatron_lm"), **on(mlm_why, session_launch(rounds))),
               Group("mlm[gpu]", ("identical_layers[mlm-gpu]", "stage_prediction[mlm-gpu]"),
                     **on(mlm_why, _mlm("6L h4096 --dynmo", "mlm_gpu")))]
    # issue 33's rows (resolved) after issue 34's: a run the budget cuts loses them first
    for sc in SCENARIOS:
        runs = 2 if sc.reference == "moe_capacity" else 1
        extra = SPARSE_CALIBRATION_S if sc.kind == "sparse_attention" else 0.0
        groups.append(Group(f"scenario_cost[{sc.kind}]", (f"scenario_cost[{sc.kind}]",), **on(why, *(
            Launch(f"{sc.kind} 8L PP=1", "worker", sc.iters, IT_S[_SCENARIO_MODEL.get(sc.kind, "s8")], extra)
            for _ in range(runs)))))
    groups += [Group("bf16_vs_fp32_speed", ("bf16_vs_fp32_speed",), **on(why, _w("4L h2048 fp32", 8, "speed_fp32"),
                                                                         _w("4L h2048 bf16", 8, "speed_bf16"))),
               Group("transformer_engine", ("transformer_engine",), **on(te_why, _w("8L h1024 TE", 8, "small")))]
    exact = [Launch(f"PP=2 8L h1024 {p}", "torchrun", 6, IT_S["small"]) for p in ("static", "moved")]
    precisions = ("fp32", "bf16") if m.bf16 else ("fp32",)
    groups += [Group(f"migration_bitexact[{p}]", (f"migration_bitexact[{p}]",), **on(two_why, *exact))
               for p in precisions]
    groups.append(Group("repack_2_to_1", ("repack_2_to_1",), **on(
        two_why, Launch("PP=2 save", "torchrun", 2, IT_S["small"]), _w("PP=1 resumed", 4, "small"),
        Launch("PP=2 -> 1 repack", "torchrun", 6, IT_S["small"]))))
    where = f"{gpus} GPU(s)" if gpus else "no GPU"
    return Plan(groups, budget_s, f"{where}, {MLM_ENV} {'set' if mlm else 'not set'}, "
                f"TE {'usable' if m.te_problem is None else 'absent'}, {rounds} throughput rounds")


def session_launch(rounds: int) -> Launch:
    """The interleaved session as the plan counts it: one start-up, the longest of its three
    programs' (two torchrun launches and a launcher-worker run, at once: START_S["torchrun"]
    32 s > START_S["worker"] 24 s), then every
    program's warm-up and rounds one after another, and a turn's hand-over each."""
    s = GPU_SESSION
    iters, dynmo = s.warmup + rounds * s.iters, s.warmup + rounds * s.dynmo_iters
    turns = (rounds + 1) * len(SESSION_PROGRAMS)
    return Launch(f"launcher, pretrain_gpt.py, pretrain_gpt.py --dynmo at once; {iters}, {iters}, {dynmo} it., "
                  f"{turns} turns", "torchrun", iters, IT_S["host"] + IT_S["mlm_host"],
                  extra_s=dynmo * IT_S["mlm_host"] + turns * BATON_TURN_S, alongside=("torchrun", "worker"))


PROBE_ROWS = ("machine", "packages", "precision_flag")
# Named sets of rows (--set NAME): the rows one device call is for
SETS = {"issue34": ("machine", "packages", "precision_flag", "shape", "mlm", "throughput")}


def start_group(gpus: int) -> Group:
    """What runs at once at the start, before any timed row: this script's probe, the
    launcher worker's imports and CUDA start, and gpu_check_nccl.py's children (its
    docstring says which rows share one). The first timed run waits for all of them."""
    import gpu_check_nccl as nccl
    rows = PROBE_ROWS + tuple(f"nccl/{n}" for n in nccl.row_names())
    children = ["shared rows", *nccl.ALONE, "determinism run 1", "determinism run 2",
                *(f"sync_free[{s}]" for s in nccl.SCENARIOS)] if gpus else ["shared rows (CPU)",
                                                                             "control_plane_cuda_state"]
    return Group(START_GROUP, rows, (Launch("gpu_check.py imports, machine probe", "parent"),
                                 Launch("launcher worker: torch, Megatron-Core, CUDA", "process", starts_worker=True),
                                 *(Launch(f"nccl child: {c}", "process", extra_s=NCCL_LONGEST_ROW_S, feeds=("nccl/",))
                                   for c in children)), parallel=True)


def target_plan(rounds: int = THROUGHPUT_ROUNDS) -> Plan:
    """The plan on the machines the check is for: one GPU, Megatron-LM given, no TE (the
    lent H100/H200 machines)."""
    return build_plan(Machine(gpus=["one GPU"], bf16=True, te_problem="assumed absent"), rounds, mlm=True)


MLM_SCRIPT_LAUNCHES = (("20 it. 4L h512, profiled, saved", 20), ("resumed at 10", 10), ("MoE 4 experts", 6))
# megatron_lm_gpu_check.sh's work beside each launch's start-up and iterations: the mock
# data's build, the saves and loads, its checks' own Python (TensorBoard's reader).
# h200-acceptance-1: 138 s for the three (the MoE run failing at its first iteration),
# ~46 s a launch against torchrun's 32 s of start-up
MLM_SCRIPT_EXTRA_S = 14.0


def device_plan(plan: Plan, total_s: float, megatron_lm: bool = True) -> Plan:
    """scripts/device_check.sh's plan: installing the carried wheels, this check's groups
    (its --budget-s, --only/--set applied), then megatron_lm_gpu_check.sh's three
    pretrain_gpt.py launches (not with `megatron_lm` False: --no-megatron-lm)."""
    install = Group("install (device_check.sh)", ("install",), (Launch("pip --no-index --target", "parent"),))
    mlm = Group("megatron_lm_gpu_check.sh", ("megatron_lm_gpu_check",), tuple(
        Launch(f"pretrain_gpt.py {what}", "torchrun", iters, IT_S["small"], MLM_SCRIPT_EXTRA_S)
        for what, iters in MLM_SCRIPT_LAUNCHES))
    only = f", --only {','.join(plan.only)}" if plan.only else ""
    return Plan([install, *plan.chosen(), *((mlm,) if megatron_lm else ())], total_s, plan.assumes +
                f"; device_check.sh{'' if megatron_lm else ' --no-megatron-lm'}, gpu_check.sh --budget-s "
                f"{plan.budget_s:.0f}{only}")


def _selected_rows(group: Group, only: tuple[str, ...]) -> list[str]:
    return group.selected_rows(only)


SKIPPED_STOPPED = "skipped: stopped"
STOPPED_WHY = "stopped by SIGTERM (device_check.sh's time limit?)"


class Stopped(BaseException):
    """SIGTERM: scripts/device_check.sh's hard limit on this script (or a user's kill).
    Not an Exception, so no row's guard takes it for that row's failure: the run stops,
    its runs are killed, and the rows done so far still make the table and the JSON."""


# SIGTERM raises Stopped only while the groups run (`armed`); elsewhere (the table and
# the JSON being written, the worker stopping) it is only recorded (`seen`)
_SIGTERM = {"armed": False, "seen": False}


def _stop(signum: int, frame) -> None:
    _SIGTERM["seen"] = True
    if _SIGTERM["armed"]:
        _SIGTERM["armed"] = False  # once
        raise Stopped(STOPPED_WHY)


def _with_sigterm(fn: Callable[[], int]) -> int:
    """`fn()` with SIGTERM handled by `_stop` (main thread only): it stops the groups, and
    only is recorded while the table and the JSON are written; the caller's handler is
    restored after (a test calling main() must not leave pytest ignoring SIGTERM)."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return fn()
    _SIGTERM.update(armed=False, seen=False)
    old = signal.signal(signal.SIGTERM, _stop)
    try:
        return fn()
    finally:
        signal.signal(signal.SIGTERM, old)


def run_group(group: Group, checks: dict, m: Machine, only: tuple[str, ...], worker: bool, done: list[Row],
              run: bool = True, estimate_s: Optional[float] = None) -> None:
    """The group's rows, appended to `done` one by one as they are judged (a stop keeps
    them); all 'skipped: budget' when the schedule says it no longer fits."""
    names = _selected_rows(group, only)
    left = launching.BUDGET.left()
    estimate_s = group.estimate_s() if estimate_s is None else estimate_s
    if not run or (group.launches and left < estimate_s):
        _log(f"group {group.name}: estimated {estimate_s:.0f} s, {max(0.0, left):.0f} s left: skipped")
        done += [Row(n, SKIPPED_BUDGET, f"estimated {estimate_s:.0f} s (re-estimated from the groups run), "
                                        f"{max(0.0, left):.0f} s left of --budget-s {launching.BUDGET.seconds:.0f}") for n in names]
        return
    if group.name != START_GROUP:
        done += (_run_row(name, checks[name]) for name in names)
        return
    nccl = [n for n in names if n.startswith("nccl/")]
    all_nccl = [n for n in group.rows if n.startswith("nccl/")]
    started = (start_nccl(m.cpu_mode, rows=None if nccl == all_nccl else nccl)  # all at once: see start_group
               if nccl else None)
    try:
        if worker:
            launching.WORKER.start()
        done += (_run_row(name, checks[name]) for name in names if name in PROBE_ROWS)
        if started is not None:
            done += [r for r in collect_nccl(*started) if r.check == "nccl" or r.check in nccl]
    except BaseException:  # stopped: gpu_check_nccl.py (a session of its own) goes too
        if started is not None:
            launching.kill_tree(started[0])
        raise


def _run_row(name: str, fn: Callable[[], Row]) -> Row:
    _log(f"check {name}")
    row = _guard(name, fn)
    _log(f"  -> {row.result} ({row.seconds:.1f} s): {row.detail}")
    return row


def run_checks(m: Machine, sizes: Sizes, out: Path, only: tuple[str, ...] = (), rounds: int = THROUGHPUT_ROUNDS,
               budget_s: Optional[float] = None) -> list[Row]:
    """Every selected row group in plan order, within `budget_s` (None: no limit)."""
    launching.BUDGET, launching.WORKER = Budget(budget_s), Worker(out / "worker.log")
    costs: dict = {}
    checks = dict(plan_checks(m, sizes, out, rounds, costs))
    plan = build_plan(m, rounds, budget_s=budget_s or math.inf)
    plan.only = only
    rows, chosen = [], plan.chosen()
    worker = any(x.needs_worker for g in chosen for x in g.launches)
    schedule = Schedule(chosen)
    try:
        _SIGTERM["armed"] = True
        if _SIGTERM["seen"]:  # it came before the groups began (armed first: none is lost)
            _SIGTERM["armed"] = False
            raise Stopped(STOPPED_WHY)
        while (step := schedule.next(launching.BUDGET.left())) is not None:
            group, run = step
            start = time.perf_counter()
            run_group(group, checks, m, only, worker, rows, run, schedule.estimate_s(group))
            if run:
                schedule.done(group, time.perf_counter() - start)
                _log(f"group {group.name}: {time.perf_counter() - start:.0f} s (estimated "
                     f"{group.estimate_s():.0f} s); later estimates x{schedule.scale:.2f}")
    except Stopped as e:
        _log(f"{e}: the rows not run say so")
        judged = {r.check for r in rows}
        rows += [Row(n, SKIPPED_STOPPED, str(e)) for g in chosen for n in _selected_rows(g, only)
                 if n not in judged]
    finally:
        _SIGTERM["armed"] = False
        launching.WORKER.stop(kill=_SIGTERM["seen"])
        launching.WORKER = None
    path = write_scenario_costs(m, costs, out)
    if path is not None:
        _log(f"per-scenario costs: {path}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="hide GPUs; run the checks that run on CPU, skip the GPU ones")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--only", default="", help="comma-separated row-name (or row-group) prefixes to run")
    parser.add_argument("--set", default=None, choices=sorted(SETS),
                        help="a named set of rows (with --only: both): " + "; ".join(
                            f"{k}: {','.join(v)}" for k, v in SETS.items()))
    parser.add_argument("--rounds", type=int, default=THROUGHPUT_ROUNDS,
                        help=f"interleaved rounds of throughput_vs_megatron_lm (default {THROUGHPUT_ROUNDS})")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"time for the whole check (default {BUDGET_S:.0f}): a row group whose "
                             "estimate no longer fits says 'skipped: budget'; every launch's timeout "
                             "is capped at what is left")
    parser.add_argument("--plan", action="store_true",
                        help="print the launch plan (row groups, launches, estimated seconds) and exit")
    parser.add_argument("--device-check", type=float, default=None, metavar="TOTAL_S",
                        help="with --plan: the plan of scripts/device_check.sh (the install, this "
                             "check, megatron_lm_gpu_check.sh) against TOTAL_S")
    parser.add_argument("--no-megatron-lm", action="store_true",
                        help="with --device-check: device_check.sh --no-megatron-lm (its plan without "
                             "megatron_lm_gpu_check.sh)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    only = tuple(x.strip() for x in args.only.split(",") if x.strip()) + SETS.get(args.set, ())
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA, here and in children
    machine = probe_machine(args.cpu)
    plan = build_plan(machine, args.rounds, budget_s=args.budget_s) if machine.gpus else target_plan(args.rounds)
    plan.budget_s, plan.only = args.budget_s, only
    if args.plan:
        if args.device_check:
            plan = device_plan(plan, args.device_check, not args.no_megatron_lm)
        print(json.dumps(plan.to_dict()) if args.json else render_plan(plan))
        return 0
    _log("\n" + render_plan(plan))  # on CPU: the plan of the machines this check is for
    return _with_sigterm(lambda: _run_and_report(args, machine, plan, only))


def _run_and_report(args: argparse.Namespace, machine: Machine, plan: Plan, only: tuple[str, ...]) -> int:
    """The rows, then the JSON (in --out) and the table or JSON on stdout; the status."""
    sizes = CPU_SIZES if not machine.gpus else GPU_SIZES
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)  # the JSON is written even where no row ran
        rows = run_checks(machine, sizes, out, only, args.rounds, args.budget_s)
        status = exit_status(rows)
        result = json.dumps({"ok": status == 0, "machine": asdict(machine),
                             "env": {"bit_exact_rows": DETERMINISM_ENV, "timing_rows": {k: worker_env().get(k) for k in DETERMINISM_ENV}},
                             "plan": plan.to_dict(), "rows": [asdict(r) for r in rows]})
        (out / "gpu_check.json").write_text(result)
    if args.json:
        print(result)
    else:
        print(render(rows))
        print(f"\nverdict: {'every check passed or was skipped' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
