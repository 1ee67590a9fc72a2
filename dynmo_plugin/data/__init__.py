"""Training data: the synthetic token stream (the default), real and synthetic documents,
packing into fixed-length micro-batches, and the cost model packers balance by.

Pure modules (`packing`, `cost_model`, `tokenizer`) import neither torch.distributed nor
megatron, and this package's `__init__` imports nothing heavy: `SyntheticTokens` and
`MicroBatch` are loaded on first use (PEP 562), so `import dynmo_plugin.data.packing`
stays torch-free.
"""
from __future__ import annotations

__all__ = ["SyntheticTokens", "MicroBatch"]


def __getattr__(name: str):
    if name in __all__:
        from dynmo_plugin.data import synthetic
        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
