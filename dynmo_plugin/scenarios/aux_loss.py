"""An auxiliary loss computed inside a pipeline stage, joined to the backward pass.

Early exit (its exit heads' loss) and Mixture of Depths (its router predictor's loss)
compute a loss on a stage that is not the last, where Megatron's schedule never sees
it. `AttachLoss` rides it on the stage's output: identity forward, and backward also
sends d(loss) = `scale` into the loss — Megatron's MoEAuxLossAutoScaler, with the scale
passed in instead of kept global.
"""
from __future__ import annotations

import torch

__all__ = ["AttachLoss"]


class AttachLoss(torch.autograd.Function):
    """`AttachLoss.apply(output, loss, scale)`: `output` unchanged; backward adds
    d(loss) = `scale` (the stage's loss scale times the loss weight)."""

    @staticmethod
    def forward(ctx, output, loss, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None
