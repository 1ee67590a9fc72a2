"""What each scenario saves on a GPU (scenario_cost rows) and the cost rows the
simulator reads."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dynmo_plugin.sim.gpu_curves import cost_rows as builder_rows  # only rows that passed
from dynmo_plugin.sim.gpu_curves import gpu_cost_model, model_name
from gpu_checks.common import CheckFailed, Machine, NO_CUDA, Row
from gpu_checks.launching import launch
from gpu_checks.rows_basic import _precision
from gpu_checks.rows_shapes import layer_costs, timed_profiles


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
    min_gib: float = 0.0  # GPU memory the run needs (a smaller GPU skips the row, saying so)


# The dense schemes judge at a GPU-bound shape with fused attention. The H200 run of
# 2026-11-27 (../shared/notes, docs/gpu.md): at h4096 s2048 mb1 a trainable layer's host
# time in the launcher (~7.5 ms) matched its kernels (7.3 ms), and Megatron's unfused
# DotProductAttention was ~3 ms of them, hiding the GEMM savings (pruning 0.81x for 0.62x
# of the FLOPs). Here: twice the tokens (s4096 mb2, ~11 ms of kernels per layer) and
# --attention-backend sdpa (torch's flash attention, as TE users get theirs).
_S8 = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32",
       "--seq-length", "4096", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local",
       "--attention-backend", "sdpa"]
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
        # micro-batch 4: at 2 a routed layer's host enqueue (~5.8 ms) outweighs its kernels
        # (~3 ms) and the 0.3 target is out of reach (scripts/roofline.py: 0.343 at mb2, 0.175 at mb4)
        [*_S8, "--micro-batch-size", "4", "--global-batch-size", "8"], _HEAD, "dense", 0.3,
        "layers 1-4 routed at capacity 0.125 vs dense layers 5-8, micro-batch 4"),
    Scenario("early_exit", {"kind": "early_exit", "early_exit": {
        "threshold": 0.2, "start": 6, "interval": 4, "loss_weight": 0.5, "min_layer": 4}},
        [*_S8, "--vocab-size", "16", "--lr", "3e-3"], _TAIL, "dense", 0.6,
        "tail layers 5-8 after exits from layer 4 on (>= 75% of tokens out) vs layers 1-4",
        iters=40, every=10),
    # FFN 4h (16384) per expert, about Mixtral 8x7B's 14336: at FFN 4096 the experts were
    # too small a part of the layer for half the capacity to reach 0.8x (0.78x by matmul
    # FLOPs); 5.5e9 parameters, ~99 GB at 18 B each + ~17 GB activations: one H200, no H100
    Scenario("moe", {"kind": "moe", "moe": {
        "num_experts": 8, "top_k": 2, "pattern": "1,1,1,1,0,0,0,0", "capacity_factor": 0.5,
        "start": 2, "interval": 1}}, _S8, _HEAD, "moe_capacity", 0.8,
        "MoE layers 1-4 (FFN 16384 per expert) at capacity factor 0.5 vs 1.0 (each over dense "
        "layers 5-8 of its run)", min_gib=120),
    Scenario("sparse_attention", {"kind": "sparse_attention", "sparse_attention": {
        "buckets": 1, "buckets_per_layer": "1:1,2:1,3:1,4:1", "final_buckets": 16, "rounds": 1,
        "start": 2, "interval": 2, "hashes": 1}},
        ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8",
         "--seq-length", "32768", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local"], _TAIL, "dense", 0.8,
        "layers 5-8 with 16 hash buckets vs dense causal layers 1-4, sequence 32768 (long-context "
        "users; at 16384 the layer is host-bound: docs/scenarios/sparse_attention.md)"),
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


def gpu_gib() -> float:
    import torch
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def check_scenario(m: Machine, sc: Scenario, out: Path, costs: dict) -> Row:
    name = f"scenario_cost[{sc.kind}]"
    if not m.gpus:
        return Row(name, NO_CUDA)
    if sc.min_gib and gpu_gib() < sc.min_gib:
        return Row(name, f"skipped: needs ~{sc.min_gib:.0f} GiB of GPU memory, this GPU has "
                         f"{gpu_gib():.0f} (an H200 runs it)")
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


def _commit() -> str:
    """The source's commit: DYNMO_SOURCE_COMMIT when the caller sent it (a device copy's
    .git need not be the tree that was sent: scripts/device_check.sh), else git's HEAD
    marked as such."""
    if os.environ.get("DYNMO_SOURCE_COMMIT"):
        return os.environ["DYNMO_SOURCE_COMMIT"]
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    head = proc.stdout.strip()
    return f"{head} (the copy's git HEAD; unverified)" if head else "unknown (no git)"


def write_scenario_costs(m: Machine, costs: dict, out: Path) -> Optional[Path]:
    if not costs:
        return None
    path = out / "scenario_costs.json"
    out.mkdir(parents=True, exist_ok=True)
    device = (m.gpus or ["cpu"])[0]
    doc = {"format": "dynmo-scenario-costs/1", "device": device, "torch": m.torch,
           "precision": "bf16" if _precision(m) else "fp32", "pipeline_model_parallel_size": 1,
           "scenarios": costs, "rows": builder_rows(costs)}
    if m.gpus:   # the simulator's named model (--hardware h200-gpu): copy it to sim/profiles/
        doc["gpu_cost_model"] = gpu_cost_model(costs, name=model_name(device), gpu=device,
                                               date=time.strftime("%Y-%m-%d", time.gmtime()),
                                               commit=_commit())
    path.write_text(json.dumps(doc, indent=1))
    return path
