"""How scripts/gpu_check.py starts runs: the launcher worker, torchrun, the budget.
`BUDGET` and `WORKER` are this module's (run_checks sets them; tests patch them here)."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from _procs import descendants
from gpu_checks.common import CheckFailed, DETERMINISM_ENV, ROOT, _log


# ---- launching ------------------------------------------------------------------------------
def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower()]
    return (errors or lines or ["(no output)"])[-1][:300]


def launch(nproc: int, flags: list[str], out: Path, timeout_s: int = 180, deterministic: bool = False) -> dict:
    """The test worker (tests/workers/train_worker.py: the real launcher plus test
    switches): one rank in the started launcher worker where there is one (`WORKER`),
    else under torchrun; returns the report. `deterministic`: a bit-exact row's launch,
    under torchrun with DETERMINISM_ENV (never in the shared worker, whose runs are timed).
    Raises CheckFailed with its error line, and BudgetExceeded where the budget, not
    `timeout_s`, stopped it."""
    if nproc == 1 and WORKER is not None and not deterministic:
        return WORKER.run(flags, out, timeout_s)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "workers.train_worker", *flags, "--output", str(out)]
    _log(f"torchrun x{nproc}: {' '.join(flags)}")
    limit, by_budget = BUDGET.limit(timeout_s)
    try:
        proc = run_killable(cmd, worker_env(deterministic), limit)
    except subprocess.TimeoutExpired as e:
        raise timed_out(limit, by_budget, ' '.join(flags[:6])) from e
    (out / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise CheckFailed(f"exit {proc.returncode}: {_error_line(proc.stderr)} (log: {out}/stderr.log)")
    from dynmo_plugin.report import read_report
    return read_report(out)


def run_killable(cmd: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own, every process below it killed at the
    timeout (`kill_tree`)."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:  # the timeout, or gpu_check.py stopped: nothing of it outlives this
            kill_tree(proc)
            _drain(proc)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every process below it (`_procs.descendants`:
    torchrun's ranks run in sessions of their own, which a group kill does not reach, and
    a surviving rank held the pipes the caller then waited on for ever), listed before the
    kill: once `proc` dies its children are re-parented and cannot be found from it."""
    if proc.returncode is not None:  # reaped: its pid (and group) may be another process's now
        return
    below = descendants(proc.pid)
    for kill, target in [(os.kill, proc.pid), (os.killpg, proc.pid), *((os.kill, pid) for pid in below)]:
        try:
            kill(target, 9)
        except (ProcessLookupError, PermissionError):
            continue


def _drain(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Wait for a killed process's pipes to close, never for ever: a process the kill did
    not see (started after the listing) may still hold them; its output is then lost."""
    try:
        proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.wait(timeout=timeout_s)


def worker_env(deterministic: bool = False) -> dict:
    """What a launcher process gets: one thread, the test workers importable, and the
    determinism settings only for a bit-exact launch (removed otherwise, even when the
    caller's environment has them)."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if k not in DETERMINISM_ENV}
    return {**env, **(DETERMINISM_ENV if deterministic else {}), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}


class BudgetExceeded(CheckFailed):
    """The run was stopped, or not started, because the --budget-s time was spent."""


def timed_out(limit: float, by_budget: bool, what: str) -> CheckFailed:
    if by_budget:
        return BudgetExceeded(f"stopped after {limit:.0f} s: the budget (--budget-s) was spent")
    return CheckFailed(f"no end after {limit:.0f} s (a hang?): {what} ...")


class Budget:
    """The whole check's time limit (--budget-s): every launch's timeout is capped at
    what is left of it, so one hung row cannot eat the rest."""

    def __init__(self, seconds: Optional[float] = None):
        self.seconds = seconds
        self.start = time.perf_counter()

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.perf_counter() - self.start)

    def limit(self, timeout_s: float) -> tuple[float, bool]:
        """(the timeout to use, whether the budget rather than `timeout_s` set it)."""
        left = max(1.0, self.left())
        return (left, True) if left < timeout_s else (timeout_s, False)


BUDGET = Budget()


class Worker:
    """scripts/gpu_check_worker.py: one process that runs the one-rank launcher runs one
    after another, so the 25-40 s start-up of a launch is paid once. A run that fails or
    hangs ends the process (its CUDA context may be poisoned); the next run starts a
    fresh one."""

    SCRIPT = ROOT / "scripts" / "gpu_check_worker.py"

    def __init__(self, log: Path, first_start_s: float = 60.0):
        self.log_path, self.first_start_s = log, first_start_s
        self.proc: Optional[subprocess.Popen] = None
        self.runs, self.last = 0, None  # runs asked for; the last reply

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, str(self.SCRIPT)], cwd=ROOT, env=worker_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.fresh = True

    def run(self, flags: list[str], out: Path, timeout_s: float) -> dict:
        self.submit(flags, out, timeout_s)
        return self.collect()

    def submit(self, flags: list[str], out: Path, timeout_s: float, baton: Optional[dict] = None) -> None:
        """Ask for a run and return at once (`collect` waits for it): the run may take its
        turns with other programs meanwhile (`baton`, scripts/gpu_checks/baton.py)."""
        out.mkdir(parents=True, exist_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        _log(f"worker run: {' '.join(flags)}")
        self.offset = self.log_path.stat().st_size
        self.limit, self.by_budget = BUDGET.limit(timeout_s + (self.first_start_s if self.fresh else 0))
        self.started, self.fresh, self.pending = time.perf_counter(), False, (flags, out)
        request = {"flags": flags, "output": str(out), **({"baton": baton} if baton else {})}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # collect() finds the process gone

    def alive(self) -> Optional[str]:
        """None while the process runs; else why not (for a baton's coordinator)."""
        if self.proc is None or self.proc.poll() is not None:
            return f"the launcher worker ended (log: {self.log_path})"
        return None

    def collect(self) -> dict:
        """The submitted run's report; CheckFailed / BudgetExceeded as `run` says."""
        flags, out = self.pending
        left = max(1.0, self.limit - (time.perf_counter() - self.started))
        reply = self._reply(left) if self.proc is not None else None
        self.runs, self.last = self.runs + 1, reply
        log = self.log_path.read_bytes()[self.offset:].decode(errors="replace")
        (out / "stderr.log").write_text(log)
        if reply is None:
            code = self.stop(kill=True)
            if code is None:
                raise timed_out(self.limit, self.by_budget, " ".join(flags[:6]))
            raise CheckFailed(f"worker exit {code}: {_error_line(log)} (log: {out}/stderr.log)")
        if not reply["ok"]:
            self.stop()  # a failed run may leave CUDA or NCCL broken: the next run starts afresh
            raise CheckFailed(f"{reply['error']}: {_error_line(log)} (log: {out}/stderr.log)")
        from dynmo_plugin.report import read_report
        return read_report(out)

    def _reply(self, limit: float) -> Optional[dict]:
        """The worker's reply line, or None when it died or `limit` passed."""
        import select
        ready, _, _ = select.select([self.proc.stdout], [], [], limit)
        line = self.proc.stdout.readline() if ready else b""
        return json.loads(line) if line.strip() else None

    def stop(self, kill: bool = False) -> Optional[int]:
        """End the process: at EOF on its stdin, or killed (with its children) when
        `kill` or when it does not leave; its exit status if it had ended by itself."""
        if self.proc is None:
            return None
        proc = self.proc  # forgotten only once it has ended: a stop in between kills it again
        code = proc.poll()
        if code is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=1 if kill else 10)
            except BaseException as e:  # OSError, the timeout, or gpu_check.py stopped meanwhile
                kill_tree(proc)
                proc.wait(timeout=10)
                if not isinstance(e, (OSError, subprocess.TimeoutExpired)):
                    raise
        self.proc = None
        self.log.close()
        return code


WORKER: Optional[Worker] = None


def losses(report: dict) -> list[float]:
    return [it["loss"] for it in report["iterations"]]


def tokens_per_s(report: dict, warmup: int = 2) -> float:
    """Tokens per second at the median iteration after `warmup` iterations."""
    cfg = report["config"]["model"]
    times = [i["time_s"] for i in report["iterations"] if i["iteration"] > warmup]
    return cfg["global_batch_size"] * cfg["seq_length"] / statistics.median(times)
