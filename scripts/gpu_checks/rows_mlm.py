"""Rows inside Megatron-LM's pretrain_gpt.py: identical layers, stage prediction,
throughput against the launcher."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from gpu_checks import launching
from gpu_checks.common import CheckFailed, DETERMINISM_ENV, Machine, NO_CUDA, ROOT, Row, _log
from gpu_checks.launching import _error_line, _free_port, launch, run_killable, timed_out
from gpu_checks.rows_basic import _precision
from gpu_checks.rows_shapes import IDENTICAL_MAX, PLUGIN_OVERHEAD_MAX, PREDICTION_ACCEPT, Runs, SHAPES, THROUGHPUT_MAX, _COMMON, identical_verdict, outside_windows, prediction_verdict, timed_profiles


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
    limit, by_budget = launching.BUDGET.limit(MLM_TIMEOUT_S)
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
