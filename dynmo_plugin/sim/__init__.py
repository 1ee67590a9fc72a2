"""Pipeline simulator: what a layout costs on a cluster this machine is not.

A discrete-event model of Megatron-Core's 1F1B and interleaved 1F1B schedules
(`schedule`, `engine`), the cost inputs of one iteration (`cost`), iteration metrics
(`iteration`), per-layer cost models of GPT layers (`gpt`), the DynMo paper's six
dynamism scenarios (`scenarios`) and static-versus-DynMo training runs (`campaign`).

Pure: imports numpy and the standard library only — never torch, torch.distributed or
megatron (a guard test enforces it).
"""
from dynmo_plugin.sim.cost import Link, PipelineCosts, ring_allreduce_s
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration

__all__ = ["Link", "PipelineCosts", "ring_allreduce_s", "IterationResult", "simulate_iteration"]
