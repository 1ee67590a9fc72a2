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
                         gpu: 6L h4096 s2048 mb1, GPU-bound), one test layer 3x heavy:
                         max/min fwd+bwd of the identical others <= 1.10
  heavy_layer[S]         the same run: the 3x layer at 3.0x +-10% its neighbours' median
  profiling_overhead[S]  the same run: profiled iterations / unprofiled ones <= 1.3
  identical_layers[mlm-S]  inside Megatron-LM's pretrain_gpt.py ($DYNMO_MEGATRON_LM),
                         --dynmo profiling: max/min of the layers <= 1.10
  throughput_vs_megatron_lm  host shape, bf16, --rounds interleaved rounds of: the
                         launcher, pretrain_gpt.py, pretrain_gpt.py --dynmo
                         --dynmo-profile-every 10: launcher/Megatron-LM <= 1.0x and
                         plugin/plain <= 1.03x (medians of the rounds; spread printed)
  scenario_cost[KIND]    each of the six scenarios at PP=1 bf16 at a shape where it
                         should save: the affected layers' cost over the reference's
                         (SCENARIOS below); also written to OUT/scenario_costs.json
                         (docs/gpu.md: the format the simulator reads)
  nccl/...               the rows of scripts/gpu_check_nccl.py --json, where it exists
--only NAME,...: run only the rows whose name (or row group's name) starts with one of
these prefixes.
--plan: print the launch plan (row groups, their launches, estimated seconds from the
constants in scripts/gpu_check_plan.py) and exit; a run prints it to stderr first.
--budget-s S (default 480, issue 24's 8 minutes): a row group starts only while its
estimate fits in what is left, else its rows say "skipped: budget"; every launch's
timeout is capped at what is left. The one-rank runs go through one launcher worker
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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_check_plan import (BUDGET_S, IT_S, NCCL_LONGEST_ROW_S, SPARSE_CALIBRATION_S, Group, Launch,  # noqa: E402
                            Plan, Schedule, render_plan)
NO_CUDA = "skipped: no CUDA"
# Bit-exact rows need deterministic kernels (issue 25 item 9): given to their launches
# only (launch(deterministic=True)); every timing run has them removed, since they slow
# the kernels they constrain (issue 34: the first H200 run timed every row under them).
DETERMINISM_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
HEAVY_LAYER, HEAVY_FACTOR, HEAVY_TOLERANCE = 3, 3, 0.25
# As tests/megatron/test_migration.py (8 layers, PP=2, start Etttt|ttttL): iteration 3 moves layers
# 5-6 to stage 0, iteration 5 moves layers 2-6 to stage 1 (both directions).
FORCED = "3:Etttttt|ttL;5:Et|tttttttL"


class CheckFailed(Exception):
    """A check's verdict is FAIL; the message is the table's detail (one line)."""


@dataclass
class Row:
    check: str
    result: str      # "pass", "FAIL" or "skipped: why"
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Machine:
    gpus: list[str] = field(default_factory=list)
    torch: str = ""
    cuda: Optional[str] = None
    te_problem: Optional[str] = "not probed"
    bf16: bool = False
    cpu_mode: bool = False


@dataclass
class Sizes:
    """Model flags per check: small on CPU, GPU-sized otherwise."""

    heavy: list[str]
    speed: list[str]
    exact: list[str]


CPU_SIZES = Sizes(
    heavy=["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "4",
           "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "3", "--dynmo-profile-every", "2", "--dynmo-profile-window", "2"],
    speed=[], exact=[])
GPU_SIZES = Sizes(
    heavy=["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
           "--seq-length", "1024", "--micro-batch-size", "2", "--global-batch-size", "16",
           "--vocab-size", "32000", "--lr", "1e-4", "--train-iters", "8",
           "--dynmo-profile-every", "5", "--dynmo-profile-window", "3"],
    speed=["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16",
           "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "8",
           "--vocab-size", "32000", "--lr", "1e-4", "--train-iters", "8"],
    exact=["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
           "--seq-length", "512", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--vocab-size", "32000", "--lr", "1e-4", "--train-iters", "6", "--seed", "11",
           "--dynmo", "--test-dump-params"])


def _log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


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
    """subprocess.run in a session of its own: at the timeout the whole session is killed
    (torchrun's workers too, which would otherwise hold the GPU after their agent died)."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
        out.mkdir(parents=True, exist_ok=True)
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        _log(f"worker run: {' '.join(flags)}")
        offset = self.log_path.stat().st_size
        limit, by_budget = BUDGET.limit(timeout_s + (self.first_start_s if self.fresh else 0))
        self.fresh = False
        try:
            self.proc.stdin.write((json.dumps({"flags": flags, "output": str(out)}) + "\n").encode())
            self.proc.stdin.flush()
            reply = self._reply(limit)
        except BrokenPipeError:
            reply = None
        self.runs, self.last = self.runs + 1, reply
        log = self.log_path.read_bytes()[offset:].decode(errors="replace")
        (out / "stderr.log").write_text(log)
        if reply is None:
            code = self.stop(kill=True)
            if code is None:
                raise timed_out(limit, by_budget, " ".join(flags[:6]))
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
        proc, self.proc = self.proc, None
        code = proc.poll()
        if code is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=1 if kill else 30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, 9)
                proc.wait()
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


# ---- verdicts (pure: unit-tested without processes) -----------------------------------------
def last_profile(report: dict) -> dict:
    profiles = [e["profile"] for e in report["events"] if e.get("kind") == "profile" and e.get("profile")]
    if not profiles:
        raise CheckFailed("the run recorded no profile")
    return profiles[-1]


def heavy_layer_verdict(profile: dict, layer: int, factor: int, tolerance: float) -> str:
    """Detail line when `layer` costs factor x (within tolerance) its neighbours' median;
    raises CheckFailed otherwise."""
    costs = {x["layer"]: x["fwd_s"] + x["bwd_s"] for x in profile["layers"]}
    others = [c for n, c in costs.items() if n != layer]
    if layer not in costs or not others:
        raise CheckFailed(f"layer {layer} or its neighbours missing from the profile ({sorted(costs)})")
    ratio = costs[layer] / statistics.median(others)
    clock = profile["stages"][0].get("clock", "?")
    detail = (f"layer {layer}: {ratio:.3f}x its neighbours' median (expected {factor}x "
              f"+-{tolerance:.0%}); {len(costs)} layers, clock {clock}")
    if abs(ratio / factor - 1) > tolerance:
        raise CheckFailed(detail)
    return detail


def compare_params(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (or exist on one side only)."""
    import torch
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def load_params(run: Path, ranks) -> dict:
    import torch
    merged: dict = {}
    for r in ranks:
        merged.update(torch.load(run / f"params_rank{r}.pt", map_location="cpu"))
    return merged


def exit_status(rows: list[Row]) -> int:
    return 1 if any(r.result == "FAIL" for r in rows) else 0


def render(rows: list[Row]) -> str:
    width = [max(len(getattr(r, k)) for r in rows + [Row("check", "result", "detail")])
             for k in ("check", "result")]
    lines = [f"{'check':<{width[0]}} | {'result':<{width[1]}} | detail",
             f"{'-' * width[0]}-+-{'-' * width[1]}-+-------"]
    lines += [f"{r.check:<{width[0]}} | {r.result:<{width[1]}} | {r.detail}"
              + (f" [{r.seconds:.0f} s]" if r.seconds >= 0.5 else "") for r in rows]
    return "\n".join(lines)


# ---- the checks -------------------------------------------------------------------------------
def probe_machine(cpu_mode: bool) -> Machine:
    import torch

    from dynmo_plugin.megatron.training.machine import transformer_engine_problem
    from dynmo_plugin.train import build_parser
    count = 0 if cpu_mode else torch.cuda.device_count()
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    return Machine(gpus=[torch.cuda.get_device_name(i) for i in range(count)],
                   torch=torch.__version__, cuda=torch.version.cuda,
                   te_problem=transformer_engine_problem() if count else "no CUDA",
                   bf16="--bf16" in flags, cpu_mode=cpu_mode)


def check_machine(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    if m.cpu_mode:
        return Row("machine", NO_CUDA, f"--cpu/--dry-run; torch {m.torch}")
    if not m.gpus:
        raise CheckFailed(f"no CUDA GPU visible (torch {m.torch}, built for CUDA {m.cuda}); "
                          "run on a GPU machine, or --dry-run to check this script on CPU")
    names = sorted(set(m.gpus))
    return Row("machine", "pass", f"{len(m.gpus)} x {', '.join(names)}; torch {m.torch}, CUDA {m.cuda}")


def check_packages(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    from importlib.metadata import version
    te = ("transformer_engine imports: default --transformer-impl transformer_engine"
          if m.te_problem is None else f"Transformer Engine not usable ({m.te_problem}): local layers")
    return Row("packages", "pass", f"megatron-core {version('megatron-core')}; {te}")


def check_precision_flag(m: Machine, _sizes: Sizes, _out: Path) -> Row:
    if m.bf16:
        return Row("precision_flag", "pass", "the launcher takes --bf16")
    return Row("precision_flag", "pass", "the launcher has no --bf16 yet: every check runs fp32")


def _precision(m: Machine) -> list[str]:
    return ["--bf16"] if m.bf16 and not m.cpu_mode else []


def check_profile_heavy_layer(m: Machine, sizes: Sizes, out: Path) -> Row:
    flags = [*sizes.heavy, "--dynmo", "--transformer-impl", "local", *_precision(m),
             "--test-heavy-layer", str(HEAVY_LAYER), "--test-heavy-factor", str(HEAVY_FACTOR)]
    report = launch(1, flags, out / "heavy")
    detail = heavy_layer_verdict(last_profile(report), HEAVY_LAYER, HEAVY_FACTOR, HEAVY_TOLERANCE)
    precision = "bf16" if _precision(m) else "fp32"
    return Row("profile_heavy_layer", "pass", f"PP=1 {precision}: {detail}")


def check_transformer_engine(m: Machine, sizes: Sizes, out: Path) -> Row:
    if not m.gpus:
        return Row("transformer_engine", NO_CUDA)
    if m.te_problem is not None:
        return Row("transformer_engine", f"skipped: TE not usable ({m.te_problem})")
    report = launch(1, [*sizes.heavy, "--dynmo", "--transformer-impl", "transformer_engine",
                        *_precision(m)], out / "te")
    got = losses(report)
    if not all(math.isfinite(x) for x in got):
        raise CheckFailed(f"non-finite loss with TE layers: {got}")
    layers = last_profile(report)["layers"]
    if len(layers) != report["config"]["model"]["num_layers"] or min(x["fwd_s"] for x in layers) <= 0:
        raise CheckFailed(f"the profile of TE layers is incomplete: {len(layers)} layers")
    return Row("transformer_engine", "pass", f"loss {got[0]:.3f} -> {got[-1]:.3f}; "
               f"{len(layers)} TE layers profiled")


def check_speed(m: Machine, sizes: Sizes, out: Path) -> Row:
    if not m.gpus:
        return Row("bf16_vs_fp32_speed", NO_CUDA)
    fp32 = launch(1, sizes.speed, out / "speed_fp32")
    impl = fp32["config"]["model"].get("transformer_impl", "?")
    t32 = tokens_per_s(fp32)
    if not m.bf16:
        return Row("bf16_vs_fp32_speed", "skipped: launcher has no --bf16",
                   f"fp32 only: {t32:,.0f} tokens/s ({impl} layers)")
    t16 = tokens_per_s(launch(1, [*sizes.speed, "--bf16"], out / "speed_bf16"))
    detail = f"fp32 {t32:,.0f} | bf16 {t16:,.0f} tokens/s = {t16 / t32:.2f}x ({impl} layers)"
    if t16 <= t32:
        raise CheckFailed(detail + "; bf16 is not faster: is --bf16 applied?")
    return Row("bf16_vs_fp32_speed", "pass", detail)


def _bitexact(name: str, a_dir: Path, a: dict, b_dir: Path, b: dict, a_ranks, b_ranks) -> None:
    if losses(a) != losses(b):
        raise CheckFailed(f"{name}: losses differ: {losses(a)} vs {losses(b)}")
    differ = compare_params(load_params(a_dir, a_ranks), load_params(b_dir, b_ranks))
    if differ:
        raise CheckFailed(f"{name}: {len(differ)} parameters differ, e.g. {differ[:3]}")


def check_migration(m: Machine, sizes: Sizes, out: Path, precision: str) -> Row:
    name = f"migration_bitexact[{precision}]"
    if len(m.gpus) < 2:
        return Row(name, NO_CUDA if not m.gpus else f"skipped: needs 2 GPUs ({len(m.gpus)} visible)")
    flags = [*sizes.exact, "--pipeline-model-parallel-size", "2"]
    flags += ["--bf16"] if precision == "bf16" else []
    static = launch(2, flags, out / f"static_{precision}", deterministic=True)
    moved = launch(2, [*flags, "--dynmo-forced-layouts", FORCED], out / f"moved_{precision}", deterministic=True)
    applied = [e.get("applied") for e in moved["events"] if e.get("kind") == "rebalance"]
    if applied != [True, True]:
        errors = [e.get("error") for e in moved["events"] if e.get("kind") == "rebalance"]
        raise CheckFailed(f"forced migrations applied {applied}: {errors}")
    _bitexact(name, out / f"static_{precision}", static, out / f"moved_{precision}", moved,
              range(2), range(2))
    moves = sum(len(e["moves"]) for e in moved["events"] if e.get("kind") == "rebalance")
    seconds = [e["migration"]["total_s"] for e in moved["events"] if e.get("kind") == "rebalance"]
    return Row(name, "pass", f"{moves} layer moves in 2 migrations ({', '.join(f'{s:.3f}' for s in seconds)} s); "
               f"{len(losses(moved))} losses and all parameters bit-exact "
               f"({moved['config']['model'].get('transformer_impl', '?')} layers)")


def check_repack(m: Machine, sizes: Sizes, out: Path) -> Row:
    if len(m.gpus) < 2:
        return Row("repack_2_to_1", NO_CUDA if not m.gpus else f"skipped: needs 2 GPUs ({len(m.gpus)} visible)")
    ckpt = out / "repack_ckpt"
    launch(2, [*sizes.exact, "--pipeline-model-parallel-size", "2", "--train-iters", "2",
               "--save", str(ckpt), "--save-interval", "2"], out / "repack_saved", deterministic=True)
    resumed = launch(1, [*sizes.exact, "--pipeline-model-parallel-size", "1", "--load", str(ckpt)],
                     out / "repack_resumed", deterministic=True)
    repacked = launch(2, [*sizes.exact, "--pipeline-model-parallel-size", "2", "--dynmo-repack",
                          "--dynmo-forced-layouts", "3:EttttttttL"], out / "repacked", deterministic=True)
    (event,) = [e for e in repacked["events"] if e.get("kind") == "rebalance"]
    rp = event.get("repack") or {}
    if not rp.get("applied") or repacked["layout"] != "EttttttttL":
        raise CheckFailed(f"repack not applied: {event.get('error') or rp.get('error')}")
    if losses(repacked)[2:] != losses(resumed):
        raise CheckFailed(f"losses after the repack differ: {losses(repacked)[2:]} vs {losses(resumed)}")
    differ = compare_params(load_params(out / "repacked", [0]), load_params(out / "repack_resumed", [0]))
    if differ:
        raise CheckFailed(f"{len(differ)} parameters differ after the repack, e.g. {differ[:3]}")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in rp.get("phase_s", {}).items())
    return Row("repack_2_to_1", "pass", f"ranks released {rp.get('ranks_released')}; phases (s): "
               f"{phases}; losses and parameters equal to the resumed PP=1 run")


# ---- the product's GPU acceptance (issues 24, 34) -----------------------------------------------
IDENTICAL_MAX, HEAVY_ACCEPT, OVERHEAD_MAX = 1.10, 0.10, 1.3
PREDICTION_ACCEPT = 0.10  # a stage's predicted time per iteration within 10% of the measured
THROUGHPUT_MAX, PLUGIN_OVERHEAD_MAX = 1.0, 1.03
THROUGHPUT_ROUNDS = 4     # interleaved rounds of throughput_vs_megatron_lm (issue 34: >= 4)
# Two heavy test layers at different factors: the cost of work k is c + k*w, so with
# neighbours (k=1) the fit gives the slope w and the intercept c (a constant per span,
# which read 3x as 2.63-2.73x on the H200). Run by the launcher worker (--gpu-check-heavy).
HEAVY_LAYERS = {3: 3, 5: 2}
_COMMON = ["--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local"]
SHAPES = {  # name: (model flags, what it is)
    "host": (["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "16"],
             "12L h1024 s1024 mb4 (host-bound)"),
    "gpu": (["--num-layers", "6", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "4"],
            "6L h4096 s2048 mb1 (GPU-bound)"),
}
SHAPE_RUN = ["--train-iters", "12", "--dynmo", "--dynmo-profile-every", "4", "--dynmo-profile-window", "1"]


def timed_profiles(report: dict) -> list[dict]:
    """Every event's measured profile (profile windows and timed rebalances), in order."""
    return [e for e in report["events"] if e.get("profile") and not e.get("cancelled")
            and e.get("profile_source", "timed") == "timed"]


def layer_costs(profile: dict) -> dict[int, float]:
    return {x["layer"]: x["fwd_s"] + x["bwd_s"] for x in profile["layers"]}


def identical_verdict(profile: dict, exclude: tuple = ()) -> tuple[float, str]:
    """(max/min fwd+bwd over the layers not excluded, detail)."""
    costs = {n: c for n, c in layer_costs(profile).items() if n not in exclude}
    if len(costs) < 2 or min(costs.values()) <= 0:
        raise CheckFailed(f"too few timed layers in the profile: {costs}")
    ratio = max(costs.values()) / min(costs.values())
    ms = " ".join(f"{1e3 * costs[n]:.2f}" for n in sorted(costs))
    return ratio, f"max/min {ratio:.3f} (<= {IDENTICAL_MAX}) over {len(costs)} layers, ms: {ms}" + _times(profile)


def _times(profile: dict) -> str:
    """Host and GPU-kernel time beside the cost (docs/profiling.md: which one is used)."""
    stage = (profile.get("stages") or [{}])[0]
    if "cost_source" not in stage:
        return ""
    return (f"; cost from {stage['cost_source']}, per iteration host {1e3 * stage.get('host_s', 0):.1f} ms, "
            f"GPU kernels {1e3 * stage.get('gpu_s', 0):.1f} ms, span constant "
            f"{1e3 * stage.get('span_constant_s', 0):.3f} ms removed")


def heavy_slope_verdict(profile: dict, heavy: dict[int, int], tolerance: float) -> str:
    """Each heavy layer at its factor +-tolerance of its neighbours' median, and the fit
    cost = c + k*w through the neighbours (k=1) and the heavy layers: the intercept c
    within tolerance of 0 (in units of a neighbour's cost). Raises CheckFailed."""
    costs = layer_costs(profile)
    others = [c for n, c in costs.items() if n not in heavy]
    if not others or any(n not in costs for n in heavy):
        raise CheckFailed(f"layers {sorted(heavy)} or their neighbours missing from the profile ({sorted(costs)})")
    base = statistics.median(others)
    ks = [1.0] * len(others) + [float(heavy[n]) for n in heavy]
    ys = [c / base for c in others] + [costs[n] / base for n in heavy]
    mk, my = statistics.fmean(ks), statistics.fmean(ys)
    slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    intercept = my - slope * mk
    ratios = {n: costs[n] / base for n in heavy}
    detail = (", ".join(f"layer {n} {ratios[n]:.3f}x (expected {k}x)" for n, k in sorted(heavy.items()))
              + f" +-{tolerance:.0%}; fit cost = {intercept:+.3f} + {slope:.3f} x work (neighbour = 1; "
              f"intercept within +-{tolerance:.2f}); neighbour {1e3 * base:.2f} ms" + _times(profile))
    if any(abs(ratios[n] / k - 1) > tolerance for n, k in heavy.items()) or abs(intercept) > tolerance:
        raise CheckFailed(detail)
    return detail


def outside_windows(times: dict[int, float], report: Optional[dict], warmup: int) -> list[float]:
    """Iteration seconds after `warmup`, without the iterations inside profiling windows."""
    inside = set()
    for e in timed_profiles(report or {"events": []}):
        lo, hi = e.get("window") or [e["iteration"], e["iteration"]]
        inside.update(range(lo, hi + 1))
    return [t for i, t in sorted(times.items()) if i > warmup and i not in inside]


def prediction_verdict(report: dict, times: dict[int, float], warmup: int = 3) -> tuple[float, str]:
    """(worst predicted/measured - 1 over the timed profiles, detail): each profile's
    predicted stage time per iteration (layers + extras + optimizer step) against the
    median iteration outside windows."""
    measured = outside_windows(times, report, warmup)
    predicted = [e["profile"]["stages"][0].get("predicted_s", 0.0) for e in timed_profiles(report)]
    if not measured or not predicted or min(predicted) <= 0:
        raise CheckFailed(f"need predicted stage times ({predicted}) and iterations outside windows")
    outside = statistics.median(measured)
    worst = max((p / outside - 1 for p in predicted), key=abs)
    detail = (f"predicted {' '.join(f'{1e3 * p:.1f}' for p in predicted)} ms/iteration vs measured "
              f"{1e3 * outside:.1f} ms outside windows (median of {len(measured)}): worst {worst:+.1%} "
              f"(<= +-{PREDICTION_ACCEPT:.0%})")
    return worst, detail


def overhead_verdict(report: dict, warmup: int = 2) -> tuple[float, str]:
    """Median time of iterations inside profiling windows over the others'."""
    inside = set()
    for e in timed_profiles(report):
        lo, hi = e.get("window") or [e["iteration"], e["iteration"]]
        inside.update(range(lo, hi + 1))
    times = {i["iteration"]: i["time_s"] for i in report["iterations"] if i["iteration"] > warmup}
    a = [t for i, t in times.items() if i in inside]
    b = [t for i, t in times.items() if i not in inside]
    if not a or not b:
        raise CheckFailed(f"need profiled and unprofiled iterations after warm-up: {sorted(inside)}")
    ratio = statistics.median(a) / statistics.median(b)
    return ratio, (f"profiled {1e3 * statistics.median(a):.1f} ms / unprofiled "
                   f"{1e3 * statistics.median(b):.1f} ms = {ratio:.3f}x (<= {OVERHEAD_MAX}x)")


class Runs:
    """Launches shared by several rows: run once, the first row pays the seconds."""

    def __init__(self):
        self._done: dict[str, object] = {}

    def get(self, key: str, start: Callable[[], object]) -> object:
        if key not in self._done:
            try:
                self._done[key] = start()
            except CheckFailed as e:
                self._done[key] = e
            except Exception as e:  # noqa: BLE001 - every row sharing the run fails with it
                self._done[key] = CheckFailed(f"{type(e).__name__}: {e}"[:300])
        value = self._done[key]
        if isinstance(value, CheckFailed):
            raise CheckFailed(f"(shared run {key}) {value}")
        return value


def _heavy_flag() -> list[str]:
    return ["--gpu-check-heavy", ",".join(f"{n}:{k}" for n, k in sorted(HEAVY_LAYERS.items()))]


def shape_run(m: Machine, shape: str, out: Path, runs: Runs) -> dict:
    flags, _ = SHAPES[shape]
    return runs.get(f"shape-{shape}", lambda: launch(
        1, [*flags, *_COMMON, *SHAPE_RUN, *_precision(m), *_heavy_flag()], out / f"shape_{shape}"))


def check_identical(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    name = f"identical_layers[{shape}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    profile = timed_profiles(shape_run(m, shape, out, runs))[-1]["profile"]
    ratio, detail = identical_verdict(profile, exclude=tuple(HEAVY_LAYERS))
    detail = f"{SHAPES[shape][1]}, launcher: {detail}"
    if ratio > IDENTICAL_MAX:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


def check_heavy(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    name = f"heavy_layer[{shape}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    profile = timed_profiles(shape_run(m, shape, out, runs))[-1]["profile"]
    return Row(name, "pass", f"{SHAPES[shape][1]}: " + heavy_slope_verdict(profile, HEAVY_LAYERS, HEAVY_ACCEPT))


def check_overhead(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    name = f"profiling_overhead[{shape}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    ratio, detail = overhead_verdict(shape_run(m, shape, out, runs))
    if ratio > OVERHEAD_MAX:
        raise CheckFailed(detail)
    return Row(name, "pass", f"{SHAPES[shape][1]}: {detail}")


def check_prediction(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    """The launcher: the profile's predicted stage time against iterations outside windows."""
    name = f"stage_prediction[{shape}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    report = shape_run(m, shape, out, runs)
    worst, detail = prediction_verdict(report, {i["iteration"]: i["time_s"] for i in report["iterations"]})
    detail = f"{SHAPES[shape][1]}, launcher: {detail}"
    if abs(worst) > PREDICTION_ACCEPT:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


# ---- inside Megatron-LM's pretrain_gpt.py ---------------------------------------------------------
MLM_ENV = "DYNMO_MEGATRON_LM"
MLM_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--bf16",
             "--lr", "1e-4", "--transformer-impl", "local", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--eval-iters", "0",
             "--eval-interval", "1000", "--log-interval", "1"]
# Like the launcher (issue 34: the first run compared unlike runs): no dropout, no gradient
# clipping, no NaN check of loss and gradients; weight decay 0.01 in both (Megatron-LM's
# default and megatron-core's OptimizerConfig default, which the launcher uses). Megatron-LM
# keeps its own data loading (DataLoader workers and pin-memory thread).
MLM_LIKE_LAUNCHER = ["--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--clip-grad", "0.0",
                     "--weight-decay", "0.01", "--no-check-for-nan-in-loss-and-grad"]
MLM_ITERS = 20
MLM_TIMEOUT_S = 240
MLM_WARMUP = 3


def mlm_launch(shape: str, dynmo: bool, out: Path) -> tuple[dict[int, float], Optional[dict]]:
    """pretrain_gpt.py through the plugin's entry (docs/megatron-lm.md) at `shape`; returns
    (seconds per iteration by iteration number, the plugin's report or None)."""
    out.mkdir(parents=True, exist_ok=True)
    flags, _ = SHAPES[shape]
    seq = flags[flags.index("--seq-length") + 1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "dynmo_plugin.integrations.pretrain_gpt", *flags, "--max-position-embeddings", seq,
           *MLM_FLAGS, *MLM_LIKE_LAUNCHER, "--train-iters", str(MLM_ITERS)]
    if dynmo:
        cmd += ["--dynmo", "--dynmo-profile-every", "10", "--dynmo-output", str(out / "dynmo")]
    env = {**{k: v for k, v in os.environ.items() if k not in DETERMINISM_ENV}, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    _log(f"pretrain_gpt.py {shape}{' --dynmo' if dynmo else ''}")
    limit, by_budget = BUDGET.limit(MLM_TIMEOUT_S)
    try:
        proc = run_killable(cmd, env, limit)
    except subprocess.TimeoutExpired as e:
        raise timed_out(limit, by_budget, f"pretrain_gpt.py {shape}") from e
    (out / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise CheckFailed(f"pretrain_gpt.py exit {proc.returncode}: {_error_line(proc.stderr)} "
                          f"(log: {out}/train.log)")
    times = mlm_iteration_s(proc.stdout + proc.stderr)
    report = json.loads((out / "dynmo" / "report.json").read_text()) if dynmo else None
    return times, report


def _mlm_ms(log: str) -> dict[int, float]:
    """Megatron-LM's 'iteration N/M | ... elapsed time per iteration (ms): X' by N."""
    import re
    found = {int(i): float(ms) for i, ms in re.findall(
        r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)", log)}
    if len(found) <= MLM_WARMUP:
        raise CheckFailed(f"Megatron-LM logged {len(found)} iteration times")
    return found


def mlm_iteration_s(log: str) -> dict[int, float]:
    """Seconds per iteration by iteration number."""
    return {i: ms / 1e3 for i, ms in _mlm_ms(log).items()}


def mlm_iteration_ms(log: str, warmup: int = MLM_WARMUP) -> list[float]:
    """Milliseconds per iteration, in order, after `warmup` iterations."""
    return [ms for i, ms in sorted(_mlm_ms(log).items()) if i > warmup]


def _mlm_skip(name: str, m: Machine) -> Optional[Row]:
    if not m.gpus:
        return Row(name, NO_CUDA)
    if not os.environ.get(MLM_ENV):
        return Row(name, f"skipped: {MLM_ENV} not set (a Megatron-LM checkout at core_v0.16.1)")
    return None


def _mlm_profiled(shape: str, out: Path, runs: Runs) -> tuple[dict[int, float], dict]:
    # the host shape's profiled run is shared with throughput_vs_megatron_lm's first round
    return runs.get(f"mlm-{shape}-dynmo-0", lambda: mlm_launch(shape, True, out / f"mlm_{shape}_dynmo_0"))


def check_mlm_identical(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    name = f"identical_layers[mlm-{shape}]"
    skip = _mlm_skip(name, m)
    if skip:
        return skip
    _, report = _mlm_profiled(shape, out, runs)
    profile = timed_profiles(report)[-1]["profile"]
    ratio, detail = identical_verdict(profile)
    detail = f"{SHAPES[shape][1]}, inside pretrain_gpt.py: {detail}"
    if ratio > IDENTICAL_MAX:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


def check_mlm_prediction(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    name = f"stage_prediction[mlm-{shape}]"
    skip = _mlm_skip(name, m)
    if skip:
        return skip
    times, report = _mlm_profiled(shape, out, runs)
    worst, detail = prediction_verdict(report, times)
    detail = f"{SHAPES[shape][1]}, inside pretrain_gpt.py: {detail}"
    if abs(worst) > PREDICTION_ACCEPT:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def throughput_verdict(ours: list[float], ratio: list[float], plugin: list[float], what: str) -> tuple[bool, str]:
    """(passed, detail) of the rounds: launcher/Megatron-LM <= THROUGHPUT_MAX (median of
    the rounds); plugin/plain <= PLUGIN_OVERHEAD_MAX judged only where the rounds' spread
    (max - min of their ratios) resolves it (< 3%), else said not resolved."""
    a, b = statistics.median(ratio), statistics.median(plugin)
    spread = max(plugin) - min(plugin)
    resolved = spread < PLUGIN_OVERHEAD_MAX - 1
    judged = (f"<= {PLUGIN_OVERHEAD_MAX}" if resolved else
              f"not judged: the rounds spread {spread:.1%}, which does not resolve {PLUGIN_OVERHEAD_MAX - 1:.0%}")
    detail = (f"{what}, {len(ratio)} interleaved rounds, like for like (no dropout, no clipping, weight decay "
              f"0.01, no NaN checks), windows excluded: launcher/Megatron-LM {a:.3f}x (rounds {_spread(ratio)}, "
              f"<= {THROUGHPUT_MAX}); --dynmo every 10 / plain {b:.3f}x (rounds {_spread(plugin)}, {judged}); "
              f"launcher {1e3 * statistics.median(ours):.1f} ms/iteration (rounds {1e3 * min(ours):.1f}-"
              f"{1e3 * max(ours):.1f})")
    return a <= THROUGHPUT_MAX and (not resolved or b <= PLUGIN_OVERHEAD_MAX), detail


def check_throughput(m: Machine, out: Path, runs: Runs, rounds: int) -> Row:
    """Interleaved rounds of the three runs at the host shape (bf16), each round in the
    same order; iterations inside profiling windows and the warm-up excluded."""
    name = "throughput_vs_megatron_lm"
    skip = _mlm_skip(name, m)
    if skip:
        return skip
    flags, what = SHAPES["host"]
    ours, ratio, plugin = [], [], []
    for r in range(rounds):
        report = launch(1, [*flags, *_COMMON, "--train-iters", str(MLM_ITERS), *_precision(m)],
                        out / f"launcher_{r}")
        launcher = statistics.median(i["time_s"] for i in report["iterations"] if i["iteration"] > MLM_WARMUP)
        plain, _ = mlm_launch("host", False, out / f"mlm_host_plain_{r}")
        profiled, dyn = runs.get(f"mlm-host-dynmo-{r}", lambda: mlm_launch("host", True, out / f"mlm_host_dynmo_{r}"))
        plain_s = statistics.median(outside_windows(plain, None, MLM_WARMUP))
        ours.append(launcher)
        ratio.append(launcher / plain_s)
        plugin.append(statistics.median(outside_windows(profiled, dyn, MLM_WARMUP)) / plain_s)
    passed, detail = throughput_verdict(ours, ratio, plugin, what)
    if not passed:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


# ---- what each scenario saves on a GPU --------------------------------------------------------
@dataclass
class Scenario:
    """One scenario_cost row: a PP=1 bf16 run, a YAML `dynamism` section, the layers the
    scheme touches and what they are compared with: "dense" (the other layers of the same
    profile) or "before" (the same layers in the run's first profile, before any event)."""

    kind: str
    dynamism: dict
    model: list[str]
    affected: tuple[int, ...]
    reference: str
    threshold: float
    what: str
    iters: int = 8
    every: int = 4
    extra: list[str] = field(default_factory=list)


# The dense schemes judge at a GPU-bound shape (issue 33: h2048 s2048 mb2 was host-bound
# with local layers, so a saving in FLOPs did not show): h4096 s2048 mb1.
_S8 = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
       "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local"]
_HEAD, _TAIL = (1, 2, 3, 4), (5, 6, 7, 8)
SCENARIOS = [
    Scenario("gradual_pruning", {"kind": "gradual_pruning", "pruning": {
        "start": 2, "interval": 2, "rounds": 1, "initial_sparsity": 0.0, "final_sparsity": 0.67,
        "granularity": "structured"}}, _S8, (*_HEAD, *_TAIL), "before", 0.75,
        "structured, 67% of FFN neurons pruned at iteration 4, vs the same layers dense", iters=9, every=3),
    Scenario("layer_freezing", {"kind": "none"}, _S8, _HEAD, "dense", 0.4,
             "layers 1-4 and the embedding frozen (a frozen prefix: forward only) vs layers 5-8",
             extra=["--test-freeze-layers", "1,2,3,4"]),
    Scenario("mixture_of_depths", {"kind": "mixture_of_depths", "mod": {
        "every": 1, "capacity": 1.0, "final_capacity": 0.125, "start": 2, "interval": 2, "rounds": 1,
        "capacity_per_layer": "5:1.0,6:1.0,7:1.0,8:1.0", "predictor_loss_weight": 0.01}},
        _S8, _HEAD, "dense", 0.3, "layers 1-4 routed at capacity 0.125 vs dense layers 5-8"),
    Scenario("early_exit", {"kind": "early_exit", "early_exit": {
        "threshold": 0.2, "start": 6, "interval": 4, "loss_weight": 0.5, "min_layer": 4}},
        [*_S8, "--vocab-size", "16", "--lr", "3e-3"], _TAIL, "dense", 0.6,
        "tail layers 5-8 after exits from layer 4 on (>= 75% of tokens out) vs layers 1-4",
        iters=40, every=10),
    Scenario("moe", {"kind": "moe", "moe": {
        "num_experts": 8, "top_k": 2, "pattern": "1,1,1,1,0,0,0,0", "capacity_factor": 0.5,
        "start": 2, "interval": 1}}, [*_S8, "--ffn-hidden-size", "4096"], _HEAD, "moe_capacity", 0.8,
        "MoE layers 1-4 at capacity factor 0.5 vs 1.0 (each over dense layers 5-8 of its run)"),
    Scenario("sparse_attention", {"kind": "sparse_attention", "sparse_attention": {
        "buckets": 1, "buckets_per_layer": "1:1,2:1,3:1,4:1", "final_buckets": 16, "rounds": 1,
        "start": 2, "interval": 2, "hashes": 1}},
        ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8",
         "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local"], _TAIL, "dense", 0.8,
        "layers 5-8 with 16 hash buckets vs dense causal layers 1-4, sequence 8192"),
]


def scenario_launch(m: Machine, sc: Scenario, out: Path, dynamism: Optional[dict] = None) -> dict:
    import yaml
    out.mkdir(parents=True, exist_ok=True)
    config = {"profiling": {"window": 1, "every": sc.every, "retime_every": 0},
              "dynamism": dynamism or sc.dynamism}
    (out / "scenario.yaml").write_text(yaml.safe_dump(config))
    return launch(1, [*sc.model, "--train-iters", str(sc.iters), *_precision(m), "--dynmo",
                      "--dynmo-config", str(out / "scenario.yaml"), *sc.extra], out)


def _median_of(costs: dict[int, float], layers) -> float:
    values = [costs[n] for n in layers if n in costs]
    if not values:
        raise CheckFailed(f"layers {list(layers)} missing from the profile ({sorted(costs)})")
    return statistics.median(values)


def scenario_ratio(sc: Scenario, profiles: list[dict], num_layers: int) -> tuple[float, dict]:
    """(affected cost / reference cost, the figures written to scenario_costs.json)."""
    last = layer_costs(profiles[-1])
    if sc.reference == "before":
        first = layer_costs(profiles[0])
        affected, reference = _median_of(last, sc.affected), _median_of(first, sc.affected)
    else:
        others = [n for n in range(1, num_layers + 1) if n not in sc.affected]
        affected, reference = _median_of(last, sc.affected), _median_of(last, others)
    layers = {x["layer"]: x for x in profiles[-1]["layers"]}
    host = {str(n): x.get("host_s", 0.0) for n, x in sorted(layers.items())}
    gpu = {str(n): x.get("gpu_s", 0.0) for n, x in sorted(layers.items())}
    return affected / reference, {"affected_cost_s": affected, "reference_cost_s": reference,
                                  "layer_cost_s": {str(n): c for n, c in sorted(last.items())},
                                  "layer_host_s": host, "layer_gpu_s": gpu}


def host_gpu_note(figures: dict) -> str:
    """Each layer's GPU-kernel and host time side by side (ms), as the last profile has them."""
    gpu, host = figures.get("layer_gpu_s", {}), figures.get("layer_host_s", {})
    pairs = " ".join(f"{n}:{1e3 * gpu.get(n, 0):.2f}/{1e3 * host.get(n, 0):.2f}" for n in figures["layer_cost_s"])
    return f"; layer:GPU/host ms {pairs}"


def _find(tree, key: str):
    """The last value of `key` anywhere in a report (e.g. the early-exit fractions)."""
    found = None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        inner = v if k == key else _find(v, key)
        found = inner if inner is not None else found
    return found


def check_scenario(m: Machine, sc: Scenario, out: Path, costs: dict) -> Row:
    name = f"scenario_cost[{sc.kind}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    report = scenario_launch(m, sc, out / f"scenario_{sc.kind}")
    profiles = [e["profile"] for e in timed_profiles(report)]
    if len(profiles) < 2:
        raise CheckFailed(f"{len(profiles)} timed profiles: need one before and one after the events")
    layers = report["config"]["model"]["num_layers"]
    ratio, figures = scenario_ratio(sc, profiles, layers)
    note = ""
    if sc.reference == "moe_capacity":
        dense_sc = Scenario(**{**sc.__dict__, "reference": "dense"})
        full = {"kind": "moe", "moe": {**sc.dynamism["moe"], "capacity_factor": 1.0}}
        ref = scenario_launch(m, sc, out / "scenario_moe_cf1", full)
        ref_ratio, _ = scenario_ratio(dense_sc, [e["profile"] for e in timed_profiles(ref)], layers)
        half_ratio, _ = scenario_ratio(dense_sc, profiles, layers)
        ratio = half_ratio / ref_ratio
        note = f"; MoE/dense {half_ratio:.3f} at 0.5, {ref_ratio:.3f} at 1.0"
    if sc.kind == "early_exit":
        fractions = _find(report["events"], "exit_fraction") or {}
        out_frac = float(fractions.get(str(sc.affected[0]), fractions.get(sc.affected[0], 0.0)))
        note = f"; {out_frac:.0%} of tokens exited before layer {sc.affected[0]}"
        figures["exited_fraction"] = out_frac
    passed = ratio <= sc.threshold and figures.get("exited_fraction", 1.0) >= 0.75
    costs[sc.kind] = {"ratio": ratio, "threshold": sc.threshold, "passed": passed, "what": sc.what,
                      "affected_layers": list(sc.affected), "reference": sc.reference,
                      "model": sc.model + sc.extra, **figures}
    detail = f"{ratio:.3f}x (<= {sc.threshold}x): {sc.what}{note}{host_gpu_note(figures)}"
    if not passed:
        raise CheckFailed(detail)
    return Row(name, "pass", detail)


# The simulator's name and curve knob for each scenario row (`dynmo_plugin.sim.profile_builder`).
# MoE is left out: its row compares capacity factors of a wider FFN, not a dense layer of
# the shape, and the busiest expert's load (the simulator's knob) is not measured here.
_BUILDER = {"gradual_pruning": lambda f: 1 - 0.67, "layer_freezing": None,
            "mixture_of_depths": lambda f: 0.125,
            "early_exit": lambda f: 1 - f["exited_fraction"], "sparse_attention": lambda f: 1 / 16}


def _flag(model: list[str], name: str, default: int) -> int:
    """A flag's value as argparse reads it: the last occurrence wins."""
    at = [i for i, token in enumerate(model[:-1]) if token == name]
    return int(model[at[-1] + 1]) if at else default


def builder_rows(costs: dict) -> list[dict]:
    """The cost rows `python -m dynmo_plugin.sim.profile_builder` reads (docs/simulator.md,
    "Cost rows"): per scenario its ratio to a dense layer of the same shape at its knob,
    and per shape one `dense` row timed by the scenario runs' dense reference layers."""
    rows, dense = [], {}
    for kind, figures in costs.items():
        if kind not in _BUILDER or not figures.get("passed"):  # a failed row is no cost (issue 34)
            continue
        model = figures["model"]
        shape = {"hidden": _flag(model, "--hidden-size", 0), "seq": _flag(model, "--seq-length", 0),
                 "micro_batch": _flag(model, "--micro-batch-size", 0),
                 "vocab": _flag(model, "--vocab-size", 50257)}
        name, knob = kind, _BUILDER[kind]
        row = {"scenario": name, "shape": shape, "ratio": figures["ratio"], "source": kind}
        if knob is not None:
            row["knob_value"] = knob(figures)
        if name == "gradual_pruning":
            row["granularity"] = "structured"
        rows.append(row)
        dense.setdefault(tuple(shape.values()), {"scenario": "dense", "shape": shape,
                                                 "ratio": 1.0, "layer_s": figures["reference_cost_s"],
                                                 "source": f"{kind} reference layers"})
    return list(dense.values()) + rows


def write_scenario_costs(m: Machine, costs: dict, out: Path) -> Optional[Path]:
    if not costs:
        return None
    path = out / "scenario_costs.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": "dynmo-scenario-costs/1", "device": (m.gpus or ["cpu"])[0],
                                "torch": m.torch, "precision": "bf16" if _precision(m) else "fp32",
                                "pipeline_model_parallel_size": 1, "scenarios": costs,
                                "rows": builder_rows(costs)}, indent=1))
    return path


# ---- scripts/gpu_check_nccl.py (the 'nccl' rows) ----------------------------------------------
NCCL_SCRIPT = ROOT / "scripts" / "gpu_check_nccl.py"


def start_nccl(cpu_mode: bool, timeout_s: float = 300) -> Optional[tuple]:
    """Start gpu_check_nccl.py --json (its children's timeouts capped at what is left of
    the budget); None where the script does not exist. `collect_nccl` reads its rows."""
    if not NCCL_SCRIPT.exists():
        return None
    _log(f"start {NCCL_SCRIPT.name}")
    limit, by_budget = BUDGET.limit(timeout_s)
    cmd = [sys.executable, str(NCCL_SCRIPT), *(["--cpu"] if cpu_mode else []), "--json",
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
        os.killpg(proc.pid, 9)
        proc.communicate()
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
        checks += [(f"identical_layers[mlm-{shape}]", lambda s=shape: check_mlm_identical(m, s, out, runs)),
                   (f"stage_prediction[mlm-{shape}]", lambda s=shape: check_mlm_prediction(m, s, out, runs))]
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
SKIPPED_BUDGET = "skipped: budget"


def _w(what: str, iters: int, model: str) -> Launch:
    return Launch(what, "worker", iters, IT_S[model])


def _mlm(what: str, model: str) -> Launch:
    return Launch(f"pretrain_gpt.py {what}, {MLM_ITERS} it.", "torchrun", MLM_ITERS, IT_S[model])


_SCENARIO_MODEL = {"moe": "s8_moe", "sparse_attention": "sparse_s8192"}


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
    for sc in SCENARIOS:
        runs = 2 if sc.reference == "moe_capacity" else 1
        extra = SPARSE_CALIBRATION_S if sc.kind == "sparse_attention" else 0.0
        groups.append(Group(f"scenario_cost[{sc.kind}]", (f"scenario_cost[{sc.kind}]",), **on(why, *(
            Launch(f"{sc.kind} 8L PP=1", "worker", sc.iters, IT_S[_SCENARIO_MODEL.get(sc.kind, "s8")], extra)
            for _ in range(runs)))))
    # round 0's profiled pretrain_gpt.py run is mlm[host]'s (shared, `Runs`); the rest of the
    # rounds are the throughput group, the most expensive: 4 rounds of 3 runs do not fit one
    # 8-minute call beside the other rows, so the schedule moves it last and a device call of
    # its own runs it (`--only throughput`, docs/gpu.md)
    rounds_launches = [x for r in range(rounds) for x in (
        _w(f"round {r}: launcher 12L h1024, {MLM_ITERS} it.", MLM_ITERS, "host"), _mlm(f"round {r}: host", "mlm_host"),
        *((_mlm(f"round {r}: host --dynmo", "mlm_host"),) if r else ()))]
    groups += [Group("mlm[host]", ("identical_layers[mlm-host]", "stage_prediction[mlm-host]"),
                     **on(mlm_why, _mlm("round 0: host --dynmo", "mlm_host"))),
               Group("mlm[gpu]", ("identical_layers[mlm-gpu]", "stage_prediction[mlm-gpu]"),
                     **on(mlm_why, _mlm("6L h4096 --dynmo", "mlm_gpu"))),
               Group("bf16_vs_fp32_speed", ("bf16_vs_fp32_speed",), **on(why, _w("4L h2048 fp32", 8, "speed_fp32"),
                                                                         _w("4L h2048 bf16", 8, "speed_bf16"))),
               Group("throughput", ("throughput_vs_megatron_lm",), **on(mlm_why, *rounds_launches)),
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


PROBE_ROWS = ("machine", "packages", "precision_flag")


def start_group(gpus: int) -> Group:
    """What runs at once at the start, before any timed row: this script's probe, the
    launcher worker's imports and CUDA start, and gpu_check_nccl.py's children (its
    docstring says which rows share one). The first timed run waits for all of them."""
    import gpu_check_nccl as nccl
    rows = PROBE_ROWS + tuple(f"nccl/{n}" for n in nccl.row_names())
    children = ["shared rows", *nccl.ALONE, "determinism run 1", "determinism run 2",
                *(f"sync_free[{s}]" for s in nccl.SCENARIOS)] if gpus else ["shared rows (CPU)",
                                                                             "control_plane_cuda_state"]
    return Group("start", rows, (Launch("gpu_check.py imports, machine probe", "parent"),
                                 Launch("launcher worker: torch, Megatron-Core, CUDA", "process"),
                                 *(Launch(f"nccl child: {c}", "process", extra_s=NCCL_LONGEST_ROW_S)
                                   for c in children)), parallel=True)


def target_plan(rounds: int = THROUGHPUT_ROUNDS) -> Plan:
    """The plan on the machines the check is for: one GPU, Megatron-LM given, no TE (the
    lent H100/H200 machines)."""
    return build_plan(Machine(gpus=["one GPU"], bf16=True, te_problem="assumed absent"), rounds, mlm=True)


MLM_SCRIPT_LAUNCHES = (("20 it. 4L h512, profiled, saved", 20), ("resumed at 10", 10), ("MoE 4 experts", 6))


def device_plan(plan: Plan, total_s: float) -> Plan:
    """scripts/device_check.sh's plan: installing the carried wheels, this check's groups
    (its --budget-s), then megatron_lm_gpu_check.sh's three pretrain_gpt.py launches."""
    install = Group("install (device_check.sh)", ("install",), (Launch("pip --no-index --target", "parent"),))
    mlm = Group("megatron_lm_gpu_check.sh", ("megatron_lm_gpu_check",), tuple(
        Launch(f"pretrain_gpt.py {what}", "torchrun", iters, IT_S["small"]) for what, iters in MLM_SCRIPT_LAUNCHES))
    return Plan([install, *plan.chosen(), mlm], total_s, plan.assumes + f"; device_check.sh, gpu_check.sh "
                f"--budget-s {plan.budget_s:.0f}", plan.only)


def _selected_rows(group: Group, only: tuple[str, ...]) -> list[str]:
    if not only or group.name.startswith(only):
        return list(group.rows)
    return [r for r in group.rows if r.startswith(only)]


def run_group(group: Group, checks: dict, m: Machine, only: tuple[str, ...], worker: bool,
              run: bool = True, estimate_s: Optional[float] = None) -> list[Row]:
    """The group's rows; all 'skipped: budget' when the schedule says it no longer fits."""
    names = _selected_rows(group, only)
    left = BUDGET.left()
    estimate_s = group.estimate_s() if estimate_s is None else estimate_s
    if not run or (group.launches and left < estimate_s):
        _log(f"group {group.name}: estimated {estimate_s:.0f} s, {max(0.0, left):.0f} s left: skipped")
        return [Row(n, SKIPPED_BUDGET, f"estimated {estimate_s:.0f} s (re-estimated from the groups run), "
                                       f"{max(0.0, left):.0f} s left of --budget-s {BUDGET.seconds:.0f}") for n in names]
    if group.name != "start":
        return [_run_row(name, checks[name]) for name in names]
    nccl = [n for n in names if n.startswith("nccl/")]
    started = start_nccl(m.cpu_mode) if nccl else None  # all at once: see start_group
    if worker:
        WORKER.start()
    rows = [_run_row(name, checks[name]) for name in names if name in PROBE_ROWS]
    if started is not None:
        rows += [r for r in collect_nccl(*started) if r.check == "nccl" or r.check in nccl]
    return rows


def _run_row(name: str, fn: Callable[[], Row]) -> Row:
    _log(f"check {name}")
    row = _guard(name, fn)
    _log(f"  -> {row.result} ({row.seconds:.1f} s): {row.detail}")
    return row


def run_checks(m: Machine, sizes: Sizes, out: Path, only: tuple[str, ...] = (), rounds: int = THROUGHPUT_ROUNDS,
               budget_s: Optional[float] = None) -> list[Row]:
    """Every selected row group in plan order, within `budget_s` (None: no limit)."""
    global BUDGET, WORKER
    BUDGET, WORKER = Budget(budget_s), Worker(out / "worker.log")
    costs: dict = {}
    checks = dict(plan_checks(m, sizes, out, rounds, costs))
    plan = build_plan(m, rounds, budget_s=budget_s or math.inf)
    plan.only = only
    rows, chosen = [], plan.chosen()
    worker = any(x.kind == "worker" for g in chosen for x in g.launches)
    schedule = Schedule(chosen)
    try:
        while (step := schedule.next(BUDGET.left())) is not None:
            group, run = step
            start = time.perf_counter()
            rows += run_group(group, checks, m, only, worker, run, schedule.estimate_s(group))
            if run:
                schedule.done(group, time.perf_counter() - start)
                _log(f"group {group.name}: {time.perf_counter() - start:.0f} s (estimated "
                     f"{group.estimate_s():.0f} s); later estimates x{schedule.scale:.2f}")
    finally:
        WORKER.stop()
        WORKER = None
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
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s:g}")
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA, here and in children
    machine = probe_machine(args.cpu)
    plan = build_plan(machine, args.rounds, budget_s=args.budget_s) if machine.gpus else target_plan(args.rounds)
    plan.budget_s, plan.only = args.budget_s, only
    if args.plan:
        if args.device_check:
            plan = device_plan(plan, args.device_check)
        print(json.dumps(plan.to_dict()) if args.json else render_plan(plan))
        return 0
    _log("\n" + render_plan(plan))  # on CPU: the plan of the machines this check is for
    sizes = CPU_SIZES if not machine.gpus else GPU_SIZES
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
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
