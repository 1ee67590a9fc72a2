"""Shared by the rows of scripts/gpu_check.py: the table's rows, the machine, the model
sizes, the pure verdicts."""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional



ROOT = Path(__file__).resolve().parents[2]
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


SKIPPED_BUDGET = "skipped: budget"


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
