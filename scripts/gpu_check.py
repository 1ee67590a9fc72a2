#!/usr/bin/env python
"""The GPU acceptance checks, one verdict table: run by scripts/gpu_check.sh (which
installs what is missing first), or directly with the packages in place.

    python scripts/gpu_check.py [--cpu] [--json] [--out DIR]

Checks, each a row `check | result | detail` (result: pass, FAIL or "skipped: why"):
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
                         becomes the embedding: see tests/test_repack.py)
--cpu (what `gpu_check.sh --dry-run` passes): hide any GPU, run what runs on CPU (the
heavy-layer profile on a small model, thread CPU time), mark the GPU checks
"skipped: no CUDA"; exits 0 when nothing failed. Without --cpu and without CUDA the
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NO_CUDA = "skipped: no CUDA"
HEAVY_LAYER, HEAVY_FACTOR, HEAVY_TOLERANCE = 3, 3, 0.25
# As tests/test_migration.py (8 layers, PP=2, start Etttt|ttttL): iteration 3 moves layers
# 5-6 to stage 0, iteration 5 moves layers 2-6 to stage 1 (both directions).
FORCED = "3:Etttttt|ttL;5:Et|tttttttL"


class CheckFailed(Exception):
    """A check's verdict is FAIL; the message is the table's detail (one line)."""


@dataclass
class Row:
    check: str
    result: str      # "pass", "FAIL" or "skipped: why"
    detail: str = ""


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


def launch(nproc: int, flags: list[str], out: Path, timeout_s: int = 900) -> dict:
    """The test worker (tests/workers/train_worker.py: the real launcher plus test
    switches) under torchrun; returns the report. Raises CheckFailed with its error line."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "workers.train_worker", *flags, "--output", str(out)]
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    _log(f"torchrun x{nproc}: {' '.join(flags)}")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise CheckFailed(f"no end after {timeout_s} s (a hang?): {' '.join(flags[:6])} ...") from e
    (out / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise CheckFailed(f"exit {proc.returncode}: {_error_line(proc.stderr)} (log: {out}/stderr.log)")
    from dynmo_plugin.report import read_report
    return read_report(out)


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
    lines += [f"{r.check:<{width[0]}} | {r.result:<{width[1]}} | {r.detail}" for r in rows]
    return "\n".join(lines)


# ---- the checks -------------------------------------------------------------------------------
def probe_machine(cpu_mode: bool) -> Machine:
    import torch

    from dynmo_plugin.config import transformer_engine_problem
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
    static = launch(2, flags, out / f"static_{precision}")
    moved = launch(2, [*flags, "--dynmo-forced-layouts", FORCED], out / f"moved_{precision}")
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
               "--save", str(ckpt), "--save-interval", "2"], out / "repack_saved")
    resumed = launch(1, [*sizes.exact, "--pipeline-model-parallel-size", "1", "--load", str(ckpt)],
                     out / "repack_resumed")
    repacked = launch(2, [*sizes.exact, "--pipeline-model-parallel-size", "2", "--dynmo-repack",
                          "--dynmo-forced-layouts", "3:EttttttttL"], out / "repacked")
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


def _guard(name: str, fn: Callable[[], Row]) -> Row:
    try:
        return fn()
    except CheckFailed as e:
        return Row(name, "FAIL", str(e))
    except Exception as e:  # noqa: BLE001 - a broken check is a failed check, with its reason
        return Row(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])


def run_checks(m: Machine, sizes: Sizes, out: Path) -> list[Row]:
    checks: list[tuple[str, Callable[[], Row]]] = [
        ("machine", lambda: check_machine(m, sizes, out)),
        ("packages", lambda: check_packages(m, sizes, out)),
        ("precision_flag", lambda: check_precision_flag(m, sizes, out)),
        ("profile_heavy_layer", lambda: check_profile_heavy_layer(m, sizes, out)),
        ("transformer_engine", lambda: check_transformer_engine(m, sizes, out)),
        ("bf16_vs_fp32_speed", lambda: check_speed(m, sizes, out)),
        ("migration_bitexact[fp32]", lambda: check_migration(m, sizes, out, "fp32")),
    ]
    if m.bf16:
        checks.append(("migration_bitexact[bf16]", lambda: check_migration(m, sizes, out, "bf16")))
    checks.append(("repack_2_to_1", lambda: check_repack(m, sizes, out)))
    rows = []
    for name, fn in checks:
        _log(f"check {name}")
        rows.append(_guard(name, fn))
        _log(f"  -> {rows[-1].result}: {rows[-1].detail}")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="hide GPUs; run the checks that run on CPU, skip the GPU ones")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA, here and in children
    machine = probe_machine(args.cpu)
    sizes = CPU_SIZES if not machine.gpus else GPU_SIZES
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        rows = run_checks(machine, sizes, out)
    status = exit_status(rows)
    if args.json:
        print(json.dumps({"ok": status == 0, "machine": asdict(machine),
                          "rows": [asdict(r) for r in rows]}))
    else:
        print(render(rows))
        print(f"\nverdict: {'every check passed or was skipped' if status == 0 else 'FAILED'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
