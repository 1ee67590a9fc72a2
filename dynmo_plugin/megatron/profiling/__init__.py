"""Per-layer time and memory on a live stage: hooks on the layers (`probe`), the tap on
Megatron's timers (`timers`), the profiling window (`profiler`) and the data-side cost
calibration built on the same probes (`calibration`)."""
