"""Megatron-Core names that exist only when Transformer Engine imports.

Megatron-Core 0.16.1's `moe_utils` imports `te_general_gemm` (and the fused MoE kernels)
inside `try: import transformer_engine ... except ImportError: HAVE_TE = False`, so
without Transformer Engine the name is never bound. Its router gating
(`router_gating_linear` -> `RouterGatingLinearFunction.forward`/`backward`) reads it
unguarded: `if te_general_gemm is not None and router_dtype != torch.float64` - a
NameError on every machine without TE, a CUDA one included (first H200 run,
../shared/notes/h200-acceptance-1.md: every MoE row and Megatron-LM's own MoE step).
Bound to None, that very test takes its torch fallback (`torch.mm`/`torch.addmm` in
router_dtype, forward and backward), which is what the code means for "no TE". The
fused kernels are read only behind `not HAVE_TE or fused_x is None`, so they need
nothing.

`bind_missing_te_names()` is called wherever a model is built: the launcher
(megatron.training.model.build_stage_model), the CPU layer (cpu_compat), and Megatron-LM's
`enable()` (integrations). Where TE imports, it changes nothing.
"""
from __future__ import annotations

__all__ = ["bind_missing_te_names"]

# (module, name) pairs Megatron-Core reads without a guard when Transformer Engine is absent
_UNGUARDED = (("megatron.core.transformer.moe.moe_utils", "te_general_gemm"),)


def bind_missing_te_names() -> list[str]:
    """Bind each unguarded TE name to None where its import failed; idempotent.
    Returns the names bound by this call (empty where TE imported or already bound)."""
    import importlib

    bound = []
    for module_name, name in _UNGUARDED:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            setattr(module, name, None)
            bound.append(f"{module_name}.{name}")
    return bound
