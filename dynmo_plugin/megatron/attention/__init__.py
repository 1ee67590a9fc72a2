"""The project's own core-attention kernels (per-document attention over packed
micro-batches) and the constructor interface they share with the scenarios' kernels."""
