"""dynmo_plugin: keep Megatron-Core pipelines balanced while the model's work changes.

The pure wings (`layout`, `balancing`, `sim`) import neither torch.distributed nor
megatron; only `dynmo_plugin.megatron` knows Megatron internals.
"""
__version__ = "0.1.0"
