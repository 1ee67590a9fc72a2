"""scenarios.gathered_tokens against references written out by hand: the gathered attention
mask is the original mask read at the gathered positions, sample by sample (what early exit
and Mixture of Depths attend with), and AttachLoss sends d(loss) = scale.

A mask shared by the batch ([1, 1, s, s], Megatron's causal mask) and one per sample
([b, 1, s, s], different in every sample: a path that read sample 0's mask for all would
pass with identical ones) take different code paths; both are checked, and the shared one
costs one indexing kernel."""
import pytest
import torch

from dynmo_plugin.profiling.op_trace import OpTrace
from dynmo_plugin.scenarios.gathered_tokens import AttachLoss, gather_mask


def _reference(mask: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """out[k, 0, i, j] = mask[k or 0, 0, idx[i, k], idx[j, k]], one element at a time."""
    c, b = idx.shape
    out = torch.empty(b, 1, c, c, dtype=torch.bool)
    for k in range(b):
        m = mask[k if mask.shape[0] > 1 else 0, 0]
        for i in range(c):
            for j in range(c):
                out[k, 0, i, j] = m[idx[i, k], idx[j, k]]
    return out


def _positions(s: int, c: int, b: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(s, generator=gen)[:c] for _ in range(b)], dim=1)  # [C, b]


@pytest.mark.parametrize("shared", [True, False], ids=["batch-shared", "per-sample"])
def test_gathered_mask_is_the_mask_at_the_gathered_positions(shared):
    gen = torch.Generator().manual_seed(0)
    s, c, b = 24, 8, 3
    mask = torch.rand(1 if shared else b, 1, s, s, generator=gen) > 0.5
    # per sample: every sample's mask differs from sample 0's
    assert all(not torch.equal(mask[k], mask[0]) for k in range(1, mask.shape[0]))
    idx = _positions(s, c, b, gen)
    with OpTrace() as trace:
        got = gather_mask(mask, idx, s, "test")
    expected = _reference(mask, idx)
    assert got.shape == (b, 1, c, c) and got.dtype == torch.bool
    assert torch.equal(got, expected)
    # shared: one indexing kernel; per sample: a gather of rows, then of columns
    assert trace.kernels() == (1 if shared else 2), [op.name for op in trace.ops]


def test_causal_mask_gathered_in_order_stays_causal():
    """Megatron's causal mask (True above the diagonal) gathered at increasing positions
    is causal again over the C kept tokens: each attends to itself and the earlier kept."""
    s, c = 16, 6
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    idx = torch.tensor([[1, 0], [4, 2], [5, 3], [9, 7], [12, 8], [15, 14]])   # [C, b], sorted
    got = gather_mask(causal, idx, s, "test")
    assert torch.equal(got, torch.triu(torch.ones(c, c, dtype=torch.bool), 1).expand(2, 1, c, c))


def test_missing_mask_is_refused_naming_the_layer():
    with pytest.raises(ValueError, match="early exit needs an explicit attention mask"):
        gather_mask(None, torch.zeros(2, 1, dtype=torch.long), 4, "early exit")


def test_attach_loss_passes_the_output_and_sends_scale_into_the_loss():
    out = torch.randn(3, 2, requires_grad=True)
    loss = torch.tensor(1.7, requires_grad=True)
    y = AttachLoss.apply(out, loss, 0.25)
    assert torch.equal(y, out)
    upstream = torch.randn(3, 2)
    d_out, d_loss = torch.autograd.grad(y, (out, loss), upstream)
    assert torch.equal(d_out, upstream)
    assert d_loss.item() == 0.25
