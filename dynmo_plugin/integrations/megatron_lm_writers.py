"""The plugin's events in Megatron-LM's TensorBoard and W&B writers: `event_scalars`
turns an event into `dynmo/...` scalars at its iteration; `WritersReport` is the run
report that hands each new event to the `Writers`, which also print one line per event.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from dynmo_plugin.report import RunReport

__all__ = ["event_scalars", "WritersReport", "Writers"]


def event_scalars(record: dict) -> dict[str, float]:
    """Scalars of one plugin event (an event's to_dict()) for TensorBoard / W&B:
    per-layer fwd/bwd ms and the stages' imbalance from its profile; for a rebalance,
    whether it applied, the imbalance it predicts after, and its overhead seconds."""
    from dynmo_plugin.balancing.metrics import imbalance
    out: dict[str, float] = {}
    profile = record.get("profile")
    if profile:
        loads: dict[int, float] = {s["stage"]: s["extra_s"] for s in profile["stages"]}
        for x in profile["layers"]:
            out[f"dynmo/layer_{x['layer']}_fwd_ms"] = x["fwd_s"] * 1e3
            out[f"dynmo/layer_{x['layer']}_bwd_ms"] = x["bwd_s"] * 1e3
            loads[x["stage"]] = loads.get(x["stage"], 0.0) + x["fwd_s"] + x["bwd_s"]
        out["dynmo/imbalance"] = imbalance(list(loads.values()))
    if record.get("kind") == "rebalance":
        out["dynmo/rebalance_applied"] = float(bool(record.get("applied")))
        if record.get("imbalance_after") is not None:
            out["dynmo/imbalance_after"] = float(record["imbalance_after"])
        out["dynmo/moved_layers"] = float(len(record.get("moves", [])))
        repack = record.get("repack") or {}
        if repack:  # a repack: the pipeline ranks and world size the run continues with
            out["dynmo/repack_stages_after"] = float(repack["stages_after"])
            out["dynmo/repack_world_size_after"] = float(repack["world_size_after"])
    for phase, seconds in record.get("overhead_s", {}).items():
        out[f"dynmo/{phase}_s"] = float(seconds)
    if record.get("kind") == "dynamism":  # a scenario's event: its count and what it changed
        out[f"dynmo/{record['scenario']}_events"] = 1.0
        detail = record.get("detail") or {}
        if "frozen_layers" in detail:
            out["dynmo/frozen_layers"] = float(len(detail["frozen_layers"]))
        if "target" in detail:  # pruning: the round's target sparsity
            out["dynmo/pruning_target"] = float(detail["target"])
        for layer, units in (record.get("work") or {}).items():
            out[f"dynmo/layer_{layer}_work"] = float(units)
    return out


@dataclasses.dataclass
class WritersReport(RunReport):
    """The run report, also handing each new event to `sink` (the writers)."""

    sink: Optional[Callable] = None

    def add_event(self, event) -> None:
        super().add_event(event)
        if self.sink is not None:
            self.sink(event)


class Writers:
    """Megatron-LM's TensorBoard and W&B writers (each exists on one rank, or none)."""

    def __init__(self):
        from megatron.training import get_tensorboard_writer, get_wandb_writer
        self.tensorboard, self.wandb = get_tensorboard_writer(), get_wandb_writer()

    def event(self, event) -> None:
        record = event if isinstance(event, dict) else event.to_dict()
        scalars = event_scalars(record)
        it = record["iteration"]
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, it)
        # Megatron-LM's writer is the wandb module: its `run` is None once the exit path ran
        # wandb.finish(), and log() raises then (a wandb.Run writer is its own run)
        if self.wandb is not None and getattr(self.wandb, "run", self.wandb) is not None:
            self.wandb.log(scalars, it)
        from megatron.training.utils import print_rank_last
        layout = record.get("layout_after") or record.get("layout")
        cause = record.get("trigger") or record.get("scenario")
        print_rank_last(f" dynmo: iteration {it} {record['kind']} [{cause}] layout "
                        f"{layout} imbalance {scalars.get('dynmo/imbalance', float('nan')):.3f}")

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()
