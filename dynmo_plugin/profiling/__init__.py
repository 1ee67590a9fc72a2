"""Per-layer time and memory from live training (device-neutral parts).

The Megatron hooks that feed these records live in `dynmo_plugin.megatron.profiling.probe`.
"""
from dynmo_plugin.profiling.clock import Clock, CpuThreadClock, CudaEventClock, WallClock, clock_for
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile

__all__ = ["Clock", "CpuThreadClock", "CudaEventClock", "WallClock", "clock_for",
           "LayerProfile", "StageProfile", "PipelineProfile"]
