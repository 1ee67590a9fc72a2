"""Checkpoints in Megatron-Core's `dist_checkpointing` format, loadable into any pipeline
split: the directory and its meta (`directory`), one stage's sharded state (`dist_ckpt`)."""
