"""A TransformerLayer that carries its own freezing state, so a migration moves it.

Layer freezing (dynmo_plugin.scenarios.layer_freezing.live) needs three things per layer that
must survive a move to another pipeline stage, so they are persistent buffers (the
migrator packs `state_dict()` and loads it into a layer built from the same spec):

* `plasticity_snapshot`  - the layer's parameters (this rank's shard) flattened at the
  last plasticity check, the W_{t-k} in ||W_t - W_{t-k}|| / ||W_{t-k}||;
* `plasticity_reference` - the layer's first plasticity measurement (0 = none yet);
* `in_frozen_prefix`     - the layer belongs to the frozen prefix (layers 1..j and the
  embedding frozen).

A layer of the frozen prefix never needs the gradient of its input: everything before
it is frozen. On the first stage autograd already skips it (the frozen embedding's
output does not require grad). On a later stage the input arrives from the pipeline
with requires_grad=True and Megatron sends its gradient back, so the layer would still
run backward for nothing (~65% of a normal backward, measured). There the layer runs
on the detached input and `_ZeroInputGrad` hands the schedule a zero input gradient
instead: the frozen layer costs its forward (plus one copy of its output) wherever it
lives, which is what the balancer assumes when it moves it. The forward values are
untouched (no arithmetic), so runs stay bit-exact whatever the layout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

__all__ = ["FreezableMixin", "freezable_spec", "is_freezable"]


class _ZeroInputGrad(torch.autograd.Function):
    """Returns `output` unchanged; its backward gives `hidden` a zero gradient (and the
    output, computed from a detached input by frozen weights, none)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device = hidden.shape, hidden.dtype, hidden.device
        return output.clone()  # an input returned as-is would be a view that forbids in-place ops

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


class FreezableMixin:
    """Mixed in front of a TransformerLayer class by `freezable_spec`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        params = list(self.parameters())
        device = params[0].device if params else torch.device("cpu")
        numel = sum(p.numel() for p in params)
        self.register_buffer("plasticity_snapshot", torch.zeros(numel, device=device))
        self.register_buffer("plasticity_reference", torch.zeros((), dtype=torch.float64,
                                                                 device=device))
        self.register_buffer("in_frozen_prefix", torch.zeros((), dtype=torch.bool, device=device))
        self._frozen = False  # the host's copy of in_frozen_prefix: forward reads no device tensor

    @property
    def frozen(self) -> bool:
        return self._frozen

    def set_frozen(self, frozen: bool) -> None:
        """Mark the layer as (not) in the frozen prefix: the buffer (which migrations and
        checkpoints carry) and the host's copy."""
        self._frozen = bool(frozen)
        self.in_frozen_prefix.fill_(self._frozen)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A migration or checkpoint brings the flag: refresh the host's copy (one read
        per load, not one per forward)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "in_frozen_prefix" in state_dict:
            self._frozen = bool(state_dict[prefix + "in_frozen_prefix"])

    def forward(self, *args, **kwargs):
        hidden = kwargs.get("hidden_states")
        if (self._frozen and torch.is_tensor(hidden) and hidden.requires_grad
                and torch.is_grad_enabled()):
            kwargs["hidden_states"] = hidden.detach()
            output, context = super().forward(*args, **kwargs)
            return _ZeroInputGrad.apply(output, hidden), context
        return super().forward(*args, **kwargs)

    # ---- plasticity -------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot_(self) -> None:
        """Remember the current weights (the reference point of the next check)."""
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.parameters()])
        self.plasticity_snapshot.copy_(flat)

    @torch.no_grad()
    def weight_change(self, include: Callable[[torch.nn.Parameter], bool]) -> tuple[float, float]:
        """(||W - W_snapshot||^2, ||W_snapshot||^2) in float64 over the parameters
        `include` accepts (each tensor-parallel rank counts its shards and rank 0 the
        replicated ones, so sums over the TP group give the full layer's norms)."""
        diff2 = norm2 = 0.0
        offset = 0
        for p in self.parameters():
            n = p.numel()
            if include(p):
                old = self.plasticity_snapshot[offset:offset + n].double()
                new = p.detach().reshape(-1).double()
                diff2 += float(torch.sum((new - old) ** 2))
                norm2 += float(torch.sum(old ** 2))
            offset += n
        return diff2, norm2


_CLASSES: dict[type, type] = {}


def _freezable_class(cls: type) -> type:
    if issubclass(cls, FreezableMixin):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Freezable{cls.__name__}", (FreezableMixin, cls),
                             {"__module__": __name__, "__doc__": FreezableMixin.__doc__})
    return _CLASSES[cls]


def freezable_spec(spec: ModuleSpec) -> ModuleSpec:
    """`spec` with its TransformerLayer class (or subclass) made freezable."""
    module = spec.module
    if not (isinstance(module, type) and issubclass(module, TransformerLayer)):
        raise TypeError(f"layer freezing needs a TransformerLayer spec, got module {module!r}")
    return dataclasses.replace(spec, module=_freezable_class(module))


def is_freezable(layer: torch.nn.Module) -> bool:
    return isinstance(layer, FreezableMixin)
