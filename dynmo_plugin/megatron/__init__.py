"""Everything that touches Megatron-Core, grouped by what it does for the plugin.

- `training/`: one pipeline stage of a Megatron-Core GPT and its training step (model
  build, process groups, p2p, the CPU compatibility layer, what the machine offers).
- `attention/`: the project's core-attention kernels and what they share.
- `data/`: Megatron's indexed datasets as document sources; the run's data pipeline.
- `migration/`: moving layers between live stages with all their state; repacking.
- `checkpoint/`: checkpoints in `dist_checkpointing` format, loadable into any split.
- `profiling/`: per-layer probes, the timer tap, profiling windows, data calibration.

The floors and who may import whom: docs/architecture.md ("Floors").
"""
