"""A profiling window on a live stage: attach hooks, tap the timers, summarise, gather.

Usage from a training loop (the controller does this):
    window = ProfileWindow(trainer)       # attaches hooks, installs the timer tap
    for it in ...: trainer.train_step(it); window.after_iteration()
    profile = window.close()              # detaches; same PipelineProfile on every rank
"""
from __future__ import annotations

import logging

import torch

from dynmo_plugin.megatron.optim_state import state_nbytes
from dynmo_plugin.megatron.probe import StageProbe
from dynmo_plugin.megatron.timers import COMPUTE_TIMERS, TimerTap
from dynmo_plugin.profiling.clock import clock_for
from dynmo_plugin.profiling.gather import gather_profile
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile, median

__all__ = ["ProfileWindow"]

logger = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _grad_bytes(p: torch.nn.Parameter) -> int:
    """Megatron DDP keeps gradients in `main_grad` views of its contiguous buffer."""
    return _nbytes(getattr(p, "main_grad", None)) or _nbytes(p.grad)


class ProfileWindow:
    """Profiles the stage owned by `trainer` until `close()`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.clock = clock_for(trainer.dims.device)
        self._saved_timers = trainer.config.timers
        self.tap = TimerTap(self._saved_timers, self.clock)
        trainer.config.timers = self.tap
        self.probe = StageProbe(trainer.model, self.clock)
        self.probe.attach()
        self._compute: list[float] = []
        self._profiled: list[float] = []
        self._wait: list[float] = []
        if trainer.dims.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def after_iteration(self) -> None:
        self._profiled.append(self.probe.end_iteration())  # resolves the clock first
        totals = self.tap.take_totals()
        self._compute.append(sum(totals.get(n, 0.0) for n in COMPUTE_TIMERS))
        self._wait.append(sum(v for n, v in totals.items() if "recv" in n))

    def close(self, perturb=None) -> PipelineProfile:
        """Detach everything, then gather: collective over the TP, DP and pipeline groups.

        `perturb(profile)` (test-only, dynmo_plugin.faults.ProfileNoise) alters the local
        profile before the gather."""
        self.cancel()
        local = self._local_profile()
        if perturb is not None:
            local = perturb(local)
        self.tap.publish({f"dynmo/layer-{x.layer:02d}/{k}": getattr(x, f"{k}_s")
                          for x in local.layers for k in ("fwd", "bwd")})
        groups = self.trainer.dims.groups
        return gather_profile(local, groups.pp, groups.dp, groups.tp)

    def cancel(self) -> None:
        """Detach hooks and restore the timers without summarising (local, no collective)."""
        self.probe.detach()
        self.trainer.config.timers = self._saved_timers

    # ---- summary ------------------------------------------------------------------------
    def _local_profile(self) -> PipelineProfile:
        t, probe = self.trainer, self.probe
        stage = t.dims.pp_rank
        layers = [self._layer_profile(layer, stage) for layer in probe.layers]
        layer_params = {id(p) for layer in probe.layers for p in layer.parameters()}
        extras = [p for p in t.model.parameters() if id(p) not in layer_params]
        extra_grad = sum(_grad_bytes(p) for p in extras)
        extra_bytes = sum(_nbytes(p) + state_nbytes(t.optimizer, p) for p in extras) + extra_grad
        static = sum(x.state_bytes for x in layers) + extra_bytes
        act = sum(x.act_bytes for x in layers)
        in_flight = min(t.dims.pp - stage, t.num_microbatches)  # 1F1B warm-up depth
        if t.dims.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated())
        else:
            peak = static + in_flight * act
        return PipelineProfile(layers, [StageProfile(
            stage=stage, extra_s=median(probe.samples["extra"]), wait_s=median(self._wait),
            peak_bytes=int(peak), extra_bytes=int(extra_bytes), extra_grad_bytes=int(extra_grad),
            compute_s=median(self._compute), profiled_s=median(self._profiled),
            num_microbatches=t.num_microbatches, clock=self.clock.name,
            peak_source="measured" if t.dims.device.type == "cuda" else "accounted")])

    def _layer_profile(self, layer, stage: int) -> LayerProfile:
        n, params = layer.layer_number, list(layer.parameters())
        return LayerProfile(
            layer=n, stage=stage,
            fwd_s=median(self.probe.samples[f"fwd/{n}"]),
            bwd_s=median(self.probe.samples[f"bwd/{n}"]),
            param_bytes=sum(_nbytes(p) for p in params),
            grad_bytes=sum(_grad_bytes(p) for p in params),
            optim_bytes=sum(state_nbytes(self.trainer.optimizer, p) for p in params),
            act_bytes=int(median(self.probe.act_bytes[n])))
