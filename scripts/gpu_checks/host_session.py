"""The host shape's interleaved session (issue 34): the launcher, pretrain_gpt.py and
pretrain_gpt.py --dynmo each started ONCE, at the same time, then taking turns on the GPU
round by round (scripts/gpu_checks/baton.py). It feeds throughput_vs_megatron_lm and the
rows of the profiled Megatron-LM run (identical_layers[mlm-host], stage_prediction[mlm-host]).

Four rounds used to cost eleven launches (4 launcher-worker runs, 7 torchrun launches,
370 s by the plan); now they cost one worker run and two torchrun launches started
together (the longest start-up counts) and warm-up + rounds x iterations of each program
(51, 51 and 83 at the GPU settings: the --dynmo program's rounds are longer) run one
program at a time. Timings leave out round 0 (the warm-up), every round's first
iteration (it follows a wait) and, in the --dynmo run, the profiling windows.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpu_checks import launching
from gpu_checks.baton import ENV, Baton, BatonSpec, BatonTimeout, overlaps
from gpu_checks.common import CheckFailed, DETERMINISM_ENV, Machine, ROOT, _log
from gpu_checks.launching import _error_line, _free_port, timed_out
from gpu_checks.rows_basic import _precision

SESSION_WARMUP = 3   # round 0: iterations before any timing
SESSION_ITERS = 12   # the launcher's and pretrain_gpt.py's iterations per round (the first and
                     # last left out: edges), a median each
DYNMO_ITERS = 20     # pretrain_gpt.py --dynmo's: 7 pairs timed with the plugin and without and 1
                     # window a round (plugin_side), 28 pairs in 4 rounds. 16 (rounds of 14)
                     # resolved a true 5% overhead at 2% per-iteration variation 56% of the
                     # time, 28: 83% (scripts/overhead_power.py); the others' rounds of 12 (were
                     # 14) keep the whole check in the plan's 480 s
# The --dynmo run's profiling windows (left out of its timings), one per round: with the
# interval equal to the round's length (and the warm-up not a multiple of it) a window
# never falls on a round's first iteration, which runs cold after another program's turn
# and would give stage_prediction[mlm-host] its worst profile (every 10 in rounds of 8:
# iteration 20 did); nor on its last, nor right before it (rows_mlm.plugin_side)
PROFILE_EVERY = DYNMO_ITERS


@dataclass(frozen=True)
class Settings:
    warmup: int       # round 0's iterations, every program
    iters: int        # the launcher's and pretrain_gpt.py's iterations per round
    dynmo_iters: int  # pretrain_gpt.py --dynmo's iterations per round
    every: int        # the --dynmo run's profile interval


GPU_SESSION = Settings(SESSION_WARMUP, SESSION_ITERS, DYNMO_ITERS, PROFILE_EVERY)
CPU_SESSION = Settings(2, 6, 8, 8)  # the dry run's: unequal lengths there too
PROGRAMS = ("launcher", "mlm", "mlm_dynmo")
# hang thresholds, under what the budget leaves at the session (~225 s of --set issue34's
# 300 s): a program not ready in 150 s (a healthy start: ~46 s) hung, and says so, rather
# than the budget ending the wait and every session row reading "skipped: budget"
READY_TIMEOUT_S, TURN_TIMEOUT_S = 150.0, 120.0
PROGRAM = ROOT / "scripts" / "gpu_checks" / "mlm_program.py"
# The dry run's models (CPU): the launcher's tiny GPT and the Megatron-LM CPU harness's
# (tests/integrations/megatron_lm_harness.py MODEL_FLAGS, one rank)
CPU_LAUNCHER = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "128", "--lr", "1e-3"]


@dataclass
class SessionResult:
    spec: BatonSpec                 # the launcher's and pretrain_gpt.py's rounds and iterations
    dynmo_spec: BatonSpec           # the --dynmo program's (longer rounds): where its plugin ran (plugin_runs)
    launcher: dict                  # the launcher's report
    plain: dict[int, float]         # pretrain_gpt.py: seconds by iteration (Megatron-LM's log)
    dynmo: dict[int, float]         # pretrain_gpt.py --dynmo: the same
    report: dict                    # the --dynmo run's plugin report
    turns: list[dict]               # [{"round", "name", "start", "end"}] as the programs timed them

    def launcher_times(self) -> dict[int, float]:
        return {i["iteration"]: i["time_s"] for i in self.launcher["iterations"]}


def _mlm_cmd(m: Machine, shape: str, dynmo: bool, out: Path, iters: int) -> list[str]:
    from gpu_checks.rows_mlm import MLM_FLAGS, MLM_LIKE_LAUNCHER
    from gpu_checks.rows_shapes import SHAPES
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), str(PROGRAM)]
    if m.gpus:
        flags, _ = SHAPES[shape]
        seq = flags[flags.index("--seq-length") + 1]
        cmd += [*flags, "--max-position-embeddings", seq, *MLM_FLAGS, *MLM_LIKE_LAUNCHER]
    else:
        sys.path.insert(0, str(ROOT / "tests" / "integrations"))
        from megatron_lm_harness import MODEL_FLAGS
        cmd += ["--cpu-harness", *MODEL_FLAGS]
    cmd += ["--train-iters", str(iters)]
    if dynmo:
        cmd += ["--dynmo", "--dynmo-profile-every", str(_settings(m).every), "--dynmo-output", str(out / "dynmo")]
    return cmd


def _settings(m: Machine) -> Settings:
    """The session's iterations and profile interval on this machine."""
    return GPU_SESSION if m.gpus else CPU_SESSION


class _Torchrun:
    """One pretrain_gpt.py program under torchrun, its output to a file."""

    def __init__(self, name: str, cmd: list[str], out: Path, spec: BatonSpec):
        out.mkdir(parents=True, exist_ok=True)
        self.name, self.out, self.log_path = name, out, out / "train.log"
        env = {**{k: v for k, v in os.environ.items() if k not in DETERMINISM_ENV},
               "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "DYNMO_TEST_LOSSES": str(out), ENV: spec.to_env(),
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        _log(f"{name}: {' '.join(cmd[cmd.index(str(PROGRAM)):])}")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> Optional[str]:
        code = self.proc.poll()
        if code is None:
            return None
        return f"{self.name} exit {code}: {_error_line(self.log_path.read_text(errors='replace'))} (log: {self.log_path})"

    def finish(self, timeout_s: float) -> dict[int, float]:
        from gpu_checks.rows_mlm import mlm_iteration_s
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        if code != 0:
            raise CheckFailed(self.alive() or f"{self.name} exit {code}")
        return mlm_iteration_s(self.log_path.read_text(errors="replace"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            launching.kill_tree(self.proc)
            self.proc.wait()
        self.log.close()


def program_spec(folder: Path, name: str, s: Settings, rounds: int) -> BatonSpec:
    """A program's rounds: the --dynmo program's longer, its plugin on and off by turns."""
    dynmo = name == "mlm_dynmo"
    return BatonSpec(str(folder), name, s.warmup, rounds, s.dynmo_iters if dynmo else s.iters,
                     s.every if dynmo else 0)


def run_session(m: Machine, out: Path, rounds: int) -> SessionResult:
    """Start the three programs at once, let them take turns, collect their timings."""
    from gpu_checks.rows_shapes import SHAPES, _COMMON
    folder = out / "session"
    baton = Baton(folder / "baton", list(PROGRAMS), rounds)
    spec = lambda name: program_spec(baton.folder, name, _settings(m), rounds)  # noqa: E731
    launcher_flags = ([*SHAPES["host"][0], *_COMMON] if m.gpus else [*CPU_LAUNCHER, "--transformer-impl", "local"])
    worker = launching.WORKER
    if worker is None:
        raise CheckFailed("the interleaved session needs the launcher worker (run through run_checks)")
    limit, _ = launching.BUDGET.limit(READY_TIMEOUT_S + (rounds + 1) * len(PROGRAMS) * TURN_TIMEOUT_S)
    start = time.perf_counter()
    deadline = time.monotonic() + limit  # one for the whole session: every wait is cut to it

    def left() -> float:
        return max(1.0, deadline - time.monotonic())
    worker.submit([*launcher_flags, "--train-iters", str(spec("launcher").train_iters), *_precision(m)], folder / "launcher",
                  limit, baton=vars(spec("launcher")))
    programs: list[_Torchrun] = []

    def alive() -> Optional[str]:
        return worker.alive() or next((why for p in programs if (why := p.alive())), None)
    try:
        for name in PROGRAMS[1:]:  # inside the try: a stop after the first start kills it
            programs.append(_Torchrun(name, _mlm_cmd(m, "host", name == "mlm_dynmo", folder / name, spec(name).train_iters),
                                      folder / name, spec(name)))
        try:
            baton.wait_ready(READY_TIMEOUT_S, alive, deadline)
            _log(f"session: all {len(PROGRAMS)} programs ready after {time.perf_counter() - start:.1f} s")
            turns = baton.turns(TURN_TIMEOUT_S, alive, _log, deadline)
        except BatonTimeout as e:  # the budget spent, or a hang (a wait's own limit)
            spent = launching.BUDGET.left() <= 1.0
            raise timed_out(time.perf_counter() - start, spent, f"interleaved session: {e}") from e
        except RuntimeError as e:
            raise CheckFailed(f"interleaved session: {e}") from e
        launcher = worker.collect()
        plain, dynmo = (p.finish(left()) for p in programs)
    except BaseException:
        for p in programs:
            p.kill()
        worker.stop(kill=True)  # its run waits for a turn that will not come
        raise
    import json
    report = json.loads((folder / "mlm_dynmo" / "dynmo" / "report.json").read_text())
    clash = overlaps(turns)
    if clash:
        raise CheckFailed(f"interleaved session: turns overlapped in time: {clash[:3]}")
    return SessionResult(spec("launcher"), spec("mlm_dynmo"), launcher, plain, dynmo, report, turns)


def round_medians(times: dict[int, float], spec: BatonSpec, skip: set[int] = frozenset()) -> list[float]:
    """Per measured round (1..rounds): the median seconds of its iterations, without the
    round's first and last (BatonSpec.edges) and without `skip` (e.g. profiling windows)."""
    edges = spec.edges()
    medians = []
    for r in range(1, spec.rounds + 1):
        kept = [times[i] for i in spec.iterations(r) if i in times and i not in edges and i not in skip]
        if not kept:
            raise CheckFailed(f"round {r}: no iteration left to time (first, last, skipped: {sorted(skip)})")
        medians.append(statistics.median(kept))
    return medians


def timing_iterations(times: dict[int, float], spec: BatonSpec) -> dict[int, float]:
    """The iterations a row may time: every round's first (after a wait) and last (the
    hand-over's sync) left out."""
    edges = spec.edges()
    return {i: t for i, t in times.items() if i not in edges}
