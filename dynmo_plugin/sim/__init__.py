"""Pipeline simulator: what a layout costs on a cluster this machine is not.

A discrete-event model of Megatron-Core's 1F1B and interleaved 1F1B schedules
(`schedule`, `engine`), the cost inputs of one iteration (`cost`), iteration metrics
(`iteration`), per-layer cost models of GPT layers (`gpt`, measured curves in
`measured` / `from_run`), the DynMo paper's six dynamism scenarios (`scenarios`) and
baselines-versus-DynMo training runs (`campaign`) whose decisions go through the live
plugin's plan -> gate path (`planner`).

Pure: numpy, the standard library and the pure wings `dynmo_plugin.balancing` and
`dynmo_plugin.config` — never torch, torch.distributed or megatron (a guard test
enforces it).
"""
from dynmo_plugin.sim.cost import Link, PipelineCosts, ring_allreduce_s
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration

__all__ = ["Link", "PipelineCosts", "ring_allreduce_s", "IterationResult", "simulate_iteration"]
