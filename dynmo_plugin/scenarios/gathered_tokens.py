"""What the layers that run on gathered tokens share (early exit, Mixture of Depths).

Both run a TransformerLayer on a subset of each sequence's tokens (those not exited;
the routed top-C), gathered at their positions, so the attention mask must be gathered
the same way (`gather_mask`). Both also compute a loss on a stage that is not the last
(exit heads; the router's predictor), where Megatron's schedule never sees it:
`AttachLoss` rides it on the stage's output — identity forward, and backward also sends
d(loss) = `scale` into the loss (Megatron's MoEAuxLossAutoScaler, with the scale passed
in instead of kept global).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["AttachLoss", "gather_mask"]


_ARBITRARY = "_dynmo_arbitrary_mask"


def arbitrary_mask(mask: torch.Tensor) -> torch.Tensor:
    """Mark `mask` as not the plain causal one. A fused core attention that takes a
    causal mask type's mask to be the causal one (megatron.attention.sdpa, as TE does)
    applies a marked mask as it is."""
    setattr(mask, _ARBITRARY, True)
    return mask


def is_arbitrary_mask(mask: torch.Tensor) -> bool:
    return getattr(mask, _ARBITRARY, False)


def gather_mask(mask: Optional[torch.Tensor], idx: torch.Tensor, s: int, layer: str) -> torch.Tensor:
    """[1 or b, 1, s, s] bool (True = masked) -> [b, 1, C, C] at the positions `idx` [C, b].
    `layer` names the caller in the error for a missing mask."""
    if mask is None:
        raise ValueError(f"{layer} needs an explicit attention mask (Megatron builds a CUDA "
                         "one when it is None)")
    c, b = idx.shape
    if mask.shape[:2] == (1, 1):  # one mask for the batch: one indexing kernel
        cols = idx.T
        return arbitrary_mask(mask[0, 0][cols[:, :, None], cols[:, None, :]][:, None])
    full = mask.expand(b, 1, s, s)
    rows = full.gather(2, idx.T[:, None, :, None].expand(b, 1, c, s))
    return arbitrary_mask(rows.gather(3, idx.T[:, None, None, :].expand(b, 1, c, c)))


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
