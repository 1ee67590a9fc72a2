"""`dynmo plan --from-run RUN_DIR` (or `--from-profile FILE`): the layout a Megatron-LM
user should start with.

A run trained with `--dynmo --dynmo-start-balanced-at N` profiled a window early on and
applied the exact solver's layout for it (trigger "start"). This rebuilds the same
balancing problem from the recorded profile (`balancing.profile_problem`, which the
live controller uses) and solves it exactly, so the printed
`--pipeline-model-parallel-layout` is the layout the live run chose when its gate let
it move. Without a "start" event, the run's first rebalance profile is used. When the
run had repacking on, the pipeline size is chosen too: the repack decision
(`plan_repack` with the run's criteria and its iteration model) without the gate, since a fresh Megatron-LM
start migrates nothing; the live run's gate may have kept the larger pipeline (the
output says what it did).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dynmo_plugin.balancing import RepackCriteria, plan_repack, solve
from dynmo_plugin.balancing.decide import repack_considered
from dynmo_plugin.balancing.problem import ProblemError
from dynmo_plugin.balancing.profile_problem import problem_from_profile
from dynmo_plugin.config import DynmoConfig, RebalanceConfig
from dynmo_plugin.config.checks import recompute_block
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout, LayoutError
from dynmo_plugin.profiling.records import PipelineProfile
from dynmo_plugin.sim.from_run import read_run_report
from dynmo_plugin.sim.problem_model import live_iteration_model

__all__ = ["recommend", "recommend_from_profile", "render", "render_profile"]


def _with_profile(report: dict, kind: str) -> list[dict]:
    return [e for e in report.get("events", []) if isinstance(e, dict) and e.get("kind") == kind
            and isinstance(e.get("profile"), dict) and e["profile"].get("layers")]


def _event(report: dict, run_dir: str, flag: str = "--from-run") -> dict:
    """The "start" rebalance event, else the first rebalance event with a profile, else
    (a profile-only run, --dynmo-profile-every) the last profile window's."""
    events = _with_profile(report, "rebalance")
    start = [e for e in events if e.get("trigger") == "start"]
    profiles = _with_profile(report, "profile")
    if not (start or events or profiles):
        raise UserError(f"{flag} {run_dir!r}: the run recorded no profile; train with --dynmo "
                        "and --dynmo-start-balanced-at N or --dynmo-profile-every N (N >= 1)")
    return (start or events)[0] if start or events else profiles[-1]


def _microbatches(report: dict, event: dict) -> int:
    if (event.get("plan") or {}).get("num_microbatches"):
        return int(event["plan"]["num_microbatches"])
    model, dp = report["config"]["model"], int(report["world"]["dp"])
    return int(model["global_batch_size"]) // (int(model["micro_batch_size"]) * dp)


def _layer_block(report: dict) -> int:
    """Whole blocks of layers per stage where the run recomputed in uniform chunks
    (`config.checks.recompute_block`), from the launcher's model settings or Megatron-LM's."""
    config = report["config"]
    return recompute_block(SimpleNamespace(**(config.get("model") or config.get("megatron_lm") or {})))


def _iteration_model(report: dict):
    """The model the live run's repack decision used (`controller.repack_iteration_model`):
    its DP size, model shape and the configured bandwidth (at the start nothing has been
    migrated yet, so no measured one)."""
    model, rb = report["config"]["model"], report["config"]["dynmo"]["rebalance"]
    return live_iteration_model(SimpleNamespace(**model), dp=int(report["world"]["dp"]),
                                bandwidth_Bps=float(rb["bandwidth_gbps"]) * 1e9)


def recommend(run_dir: str) -> dict[str, Any]:
    """The exact layout for the run's start profile, with what the live run did.

    Raises:
        UserError: no readable report, or no profile in it.
    """
    report = read_run_report(run_dir, "--from-run")  # read and shape-checked
    event = _event(report, run_dir)
    try:
        chunks = int((event.get("plan") or {}).get("num_chunks", 1))
        current = Layout.parse(event.get("layout_before") or event["layout"], num_chunks=chunks)
        rb = report["config"]["dynmo"]["rebalance"]
        config = DynmoConfig(rebalance=RebalanceConfig(memory_cap_gb=float(rb["memory_cap_gb"]),
                                                       allow_empty_stages=bool(rb["allow_empty_stages"])))
        problem = problem_from_profile(PipelineProfile.from_dict(event["profile"]), current, config,
                                       _microbatches(report, event),
                                       peak_microbatches=(event.get("memory") or {}).get("peak_microbatches"),
                                       layer_block=_layer_block(report))
        plan = solve(problem, "exact")
        layout, predicted = plan.layout, plan.predicted_iter_s_after
        rp = report["config"]["dynmo"].get("repack") or {}
        criteria = None if not rp.get("enabled") else RepackCriteria(
            min_stages=int(rp["min_stages"]), max_slowdown=float(rp["max_slowdown"]),
            objective=rp["objective"], memory_margin=float(rp["memory_margin"]),
            rebuild_s=float(rp["rebuild_s"]))
        if repack_considered(problem, criteria) and not problem.mtp_layers:  # no MTP repacks yet
            repack = plan_repack(problem, criteria, iteration_model=_iteration_model(report))
            if repack.apply:
                layout, predicted = repack.layout_after, repack.predicted_iter_s_after
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, LayoutError,
            ProblemError) as e:
        raise UserError(f"--from-run {run_dir!r}: its report lacks or mangles what the plan needs "
                        f"({type(e).__name__}: {e})") from e
    return {"run": str(Path(run_dir)), "trigger": event.get("trigger"), "window": event.get("window"),
            "layout_profiled": str(current),
            "pipeline_model_parallel_size": layout.num_ranks,
            "num_virtual_stages_per_pipeline_rank": layout.num_chunks,
            "pipeline_model_parallel_layout": layout.to_megatron(),
            "predicted_iter_s": predicted,
            "predicted_iter_s_profiled": plan.predicted_iter_s_before,
            "mtp": _mtp_placement(current, layout),
            "live": {"iteration": event.get("iteration"), "applied": bool(event.get("applied")),
                     "layout_after": event.get("layout_after"),
                     "reason": event.get("reason") or "profile only: nothing moves"}}


def _profile_file(path: str) -> tuple[PipelineProfile, int]:
    """A profile as the live run records it: `PipelineProfile.to_dict()` ({layers,
    stages[, num_chunks]}), or a report event holding one under "profile"; with the
    layer block of the run whose report.json it came from (1 otherwise)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--from-profile {path!r}: cannot read it ({e.strerror or e}); pass a "
                        "profile JSON file") from e
    except ValueError as e:
        raise UserError(f"--from-profile {path!r}: not JSON ({e})") from e
    block = 1
    if isinstance(data, dict) and isinstance(data.get("events"), list) and "layers" not in data:
        try:  # the run's recompute chunks
            block = _layer_block(data) if isinstance(data.get("config"), dict) else 1
        except (TypeError, ValueError) as e:
            raise UserError(f"--from-profile {path!r}: its config does not read as a run's "
                            f"({type(e).__name__}: {e})") from e
        data = _event(data, path, "--from-profile")  # a run's report.json: its profile event
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    if not isinstance(data, dict):
        raise UserError(f"--from-profile {path!r}: holds a JSON {type(data).__name__}, not a profile; "
                        "give a profile ({\"layers\": [...], \"stages\": [...]}), a profile event or a "
                        "run's report.json")
    try:
        profile = PipelineProfile.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"--from-profile {path!r}: not a profile ({{\"layers\": [...], \"stages\": "
                        f"[...]}} as a run's report events record it): {type(e).__name__}: {e}") from e
    if not profile.layers or not profile.stages:
        raise UserError(f"--from-profile {path!r}: the profile has no layers or no stages")
    return profile, block


def recommend_from_profile(path: str) -> dict[str, Any]:
    """The exact layout for a recorded profile, without its run: the layout it was
    profiled under is read from the layers' stages, the micro-batches from the stages'
    records (1 when not recorded); no memory cap, no repack (the run's settings are not
    in a profile: use --from-run for those). From a run's report.json, whole chunks of its
    uniform recompute (`_layer_block`).

    Raises:
        UserError: an unreadable file or not a profile.
    """
    profile, block = _profile_file(path)
    try:
        counts = [0] * len(profile.stages)
        for x in profile.layers:
            counts[x.stage] += 1
        mtp = profile.mtp
        current = Layout(tuple(counts), profile.num_chunks, mtp.layer if mtp else 0,
                         mtp.stage if mtp else None)
        m = max(s.num_microbatches for s in profile.stages) or 1
        problem = problem_from_profile(profile, current, DynmoConfig(), m, layer_block=block)
        plan = solve(problem, "exact")
    except (IndexError, TypeError, ValueError, LayoutError, ProblemError) as e:
        raise UserError(f"--from-profile {path!r}: the profile does not make a problem "
                        f"({type(e).__name__}: {e})") from e
    layout = plan.layout
    return {"profile": str(Path(path)), "layout_profiled": str(current), "num_microbatches": m,
            "pipeline_model_parallel_size": layout.num_ranks,
            "num_virtual_stages_per_pipeline_rank": layout.num_chunks,
            "pipeline_model_parallel_layout": layout.to_megatron(),
            "predicted_iter_s": plan.predicted_iter_s_after,
            "predicted_iter_s_profiled": plan.predicted_iter_s_before,
            "mtp": _mtp_placement(current, layout)}


def _mtp_placement(before: Layout, after: Layout) -> dict[str, Any] | None:
    """Where the recommended layout puts the MTP block, and where it was profiled."""
    if not after.has_mtp:
        return None
    return {"layers": after.mtp_layers, "stage": after.mtp_stage, "rank": after.mtp_rank,
            "standalone": after.mtp_standalone, "profiled_stage": before.mtp_stage}


def _mtp_line(rec: dict[str, Any]) -> list[str]:
    mtp = rec.get("mtp")
    if not mtp:
        return []
    where = (f"standalone on rank {mtp['rank']}" if mtp["standalone"]
             else f"on the last rank ({mtp['rank']})")
    moved = ("where it was profiled" if mtp["profiled_stage"] == mtp["stage"]
             else f"moved from stage {mtp['profiled_stage']}")
    return [f"MTP block ({mtp['layers']} layer(s)): {where}, stage {mtp['stage']}; {moved}"]


def _flags(rec: dict[str, Any]) -> str:
    flags = (f"--pipeline-model-parallel-size {rec['pipeline_model_parallel_size']} "
             f"--pipeline-model-parallel-layout '{rec['pipeline_model_parallel_layout']}'")
    if rec.get("mtp"):
        flags += f" --mtp-num-layers {rec['mtp']['layers']}"
    if rec["num_virtual_stages_per_pipeline_rank"] > 1:
        flags += f" --num-virtual-stages-per-pipeline-rank {rec['num_virtual_stages_per_pipeline_rank']}"
    return flags


def render_profile(rec: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(rec, indent=2, allow_nan=False)
    return "\n".join([
        f"from profile {rec['profile']} under {rec['layout_profiled']} "
        f"({rec['num_microbatches']} micro-batches)",
        "recommended for Megatron-LM (exact solver on the measured profile):",
        f"  {_flags(rec)}",
        *_mtp_line(rec),
        f"predicted iteration {rec['predicted_iter_s']:.4g} s (the profiled layout "
        f"{rec['predicted_iter_s_profiled']:.4g} s)"])


def render(rec: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(rec, indent=2, allow_nan=False)
    flags = _flags(rec)
    live = rec["live"]
    did = (f"applied {live['layout_after']} at iteration {live['iteration']}" if live["applied"]
           else f"kept {rec['layout_profiled']} ({live['reason']})")
    return "\n".join([
        f"from run {rec['run']}: profile of iterations {rec['window']} (trigger {rec['trigger']}) "
        f"under {rec['layout_profiled']}",
        "recommended for Megatron-LM (exact solver on the measured profile):",
        f"  {flags}",
        *_mtp_line(rec),
        f"predicted iteration {rec['predicted_iter_s']:.4g} s (the profiled layout "
        f"{rec['predicted_iter_s_profiled']:.4g} s)",
        f"the live run {did}"])
