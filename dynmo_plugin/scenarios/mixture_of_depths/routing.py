"""The routed layer's own autograd: what a Mixture-of-Depths block adds to the block it
wraps, with hand-written backwards that launch only the kernels they need.

A routed layer at capacity 0.125 runs its block on 1/8 of the tokens; on a GPU that
block is a few milliseconds, and each extra kernel costs the host ~35 us to enqueue
(docs/roofline.md). Left to autograd, the router, top-C, the gathers, the gated scatter
and the predictor's loss took 44 extra kernels per forward + backward (an h4096 s4096 mb2
layer, --attention-backend sdpa): the host, not the GPU, set the layer's time. Here:

* `RouteIn`: router logits (one GEMV), top-C per sequence with the indices sorted
  (original order: the causal mask among the selected tokens is the causal mask), the
  gate sigmoid(logit) and the gathered block input. Its backward gives x its whole
  gradient in one scatter_add: the residual's (passed as is), the block input's, the
  gate's -gate * g and the router's logit gradient x weight, summed at the selected rows.
* `RouteOut`: out = x + gate * (block(x~) - x~) at the selected rows (one scatter_add,
  the same arithmetic as before). Its backward hands the output gradient to `RouteIn`
  through the `box` both share (one per forward call, so interleaved micro-batches do
  not mix), so x's gradient is not assembled from three autograd branches.
* `PredictorGrad`: the auxiliary predictor's binary cross-entropy gradient, computed in
  the backward (the predictor's forward included: the loss value is never reported) in
  the kernels a hand-written backward of Linear -> SiLU -> Linear needs.

Gradients equal autograd's of the same expressions to rounding
(tests/scenarios/test_mod_kernels.py compares them in float64).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["RouteIn", "RouteOut", "PredictorGrad"]

_aten = torch.ops.aten


class RouteIn(torch.autograd.Function):
    """`RouteIn.apply(x [s, b, h], router_weight [1, h], c, box)` -> (x_sel [c, b, h],
    gate [c, b], idx [c, b]): each sequence's top-c tokens by router logit, in their
    original order (idx sorted), gathered; gate = sigmoid(their logits)."""

    @staticmethod
    def forward(ctx, x, weight, c: int, box: dict):
        s, b, h = x.shape
        logits = torch.mm(x.reshape(s * b, h), weight.t()).view(s, b)
        idx = torch.topk(logits, c, dim=0, sorted=False).indices.sort(dim=0).values
        gate = torch.sigmoid(logits.gather(0, idx))
        x_sel = x.gather(0, idx[..., None].expand(c, b, h))
        ctx.save_for_backward(weight, x_sel, gate, idx)
        ctx.box = box
        ctx.mark_non_differentiable(idx)
        ctx.set_materialize_grads(False)  # no zeros for idx's gradient (a kernel)
        return x_sel, gate, idx

    @staticmethod
    def backward(ctx, grad_x_sel, grad_gate, _grad_idx):
        weight, x_sel, gate, idx = ctx.saved_tensors
        c, b, h = x_sel.shape
        g, g_sel = ctx.box.pop("g"), ctx.box.pop("g_sel")
        if grad_x_sel is None:
            grad_x_sel = torch.zeros_like(x_sel)
        # the selected rows of x: block input's gradient - gate * g (the residual's share
        # the gated update removes) + the router's d logit x weight
        rows = torch.addcmul(grad_x_sel, g_sel, gate[..., None], value=-1)
        if grad_gate is None:
            return g.scatter_add(0, idx[..., None].expand(c, b, h), rows), None, None, None
        grad_logit = _aten.sigmoid_backward(grad_gate, gate)                   # [c, b]
        rows.addcmul_(grad_logit[..., None], weight.view(1, 1, h))
        grad_x = g.scatter_add(0, idx[..., None].expand(c, b, h), rows)
        grad_weight = torch.mm(grad_logit.view(1, c * b), x_sel.view(c * b, h))
        return grad_x, grad_weight, None, None


class RouteOut(torch.autograd.Function):
    """`RouteOut.apply(x, x_sel, y_sel, gate, idx, box)` -> x with the selected rows
    x~ + gate * (y~ - x~). x and x_sel come detached: their gradients are `RouteIn`'s
    to give (this backward leaves the output gradient in `box` for it)."""

    @staticmethod
    def forward(ctx, x, x_sel, y_sel, gate, idx, box: dict):
        delta = y_sel - x_sel
        out = x.scatter_add(0, idx[..., None].expand_as(delta), gate[..., None] * delta)
        ctx.save_for_backward(delta, gate, idx)
        ctx.box = box
        return out

    @staticmethod
    def backward(ctx, g):
        delta, gate, idx = ctx.saved_tensors
        c, b, h = delta.shape
        g_sel = g.gather(0, idx[..., None].expand(c, b, h))
        grad_y = g_sel * gate[..., None]
        # d gate = <g, y~ - x~> per token: one batched dot product
        grad_gate = torch.bmm(g_sel.view(c * b, 1, h), delta.view(c * b, h, 1)).view(c, b)
        ctx.box.update(g=g, g_sel=g_sel)
        return None, None, grad_y, grad_gate, None, None


class PredictorGrad(torch.autograd.Function):
    """`PredictorGrad.apply(output, x, idx, scale, w1, b1, w2, b2)`: `output` unchanged;
    backward also gives the predictor Linear(w1, b1) -> SiLU -> Linear(w2, b2) on x
    (detached: the backbone gets nothing) the gradient of scale x mean binary
    cross-entropy of its logits [s, b] against 1 at `idx` [C, b], 0 elsewhere:
    scale x (sigmoid(pred) - target) / (s x b), the sigmoid in float32 at least. The loss value is
    never needed, so the forward computes nothing."""

    @staticmethod
    def forward(ctx, output, x, idx, scale: float, w1, b1, w2, b2):
        ctx.save_for_backward(x, idx, w1, b1, w2, b2)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, idx, w1, b1, w2, b2 = ctx.saved_tensors
        s, b, h = x.shape
        x2 = x.reshape(s * b, h)
        pre = torch.addmm(b1, x2, w1.t())                                 # [s b, p]
        act = F.silu(pre)
        pred = torch.addmm(b2, act, w2.t())                               # [s b, 1]
        wide = torch.float64 if pred.dtype == torch.float64 else torch.float32
        grad = torch.sigmoid(pred.view(s, b).to(wide))
        grad.scatter_(0, idx, -1.0, reduce="add")
        # scale and cast in one kernel
        grad_pred = torch.mul(grad, ctx.scale / (s * b),
                              out=torch.empty(s, b, dtype=pred.dtype, device=pred.device)).view(s * b, 1)
        grad_act = torch.mm(grad_pred, w2)
        grad_w2, grad_b2 = torch.mm(grad_pred.t(), act), grad_pred.sum(0)
        grad_pre = _aten.silu_backward(grad_act, pre)
        grad_w1, grad_b1 = torch.mm(grad_pre.t(), x2), grad_pre.sum(0)
        return grad_output, None, None, None, grad_w1, grad_b1, grad_w2, grad_b2
