"""One pipeline stage of a Megatron-Core GPT and its training step: the model build, the
process groups, p2p with shape exchange, the CPU compatibility layer and what the machine
offers (CUDA GPUs, Transformer Engine)."""
