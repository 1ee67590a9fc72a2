"""OpTrace counts what a forward + backward dispatches: matmul FLOPs, kernels, host reads."""
import torch

from dynmo_plugin.profiling.op_trace import OpTrace


def test_linear_forward_backward_flops_kernels_and_dims():
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=False)
    x = torch.randn(16, 24, requires_grad=True)
    with OpTrace() as trace:
        lin(x).sum().backward()
    # forward 2*16*24*40, backward twice that (grad of input and of weight)
    assert trace.flops() == 3 * 2 * 16 * 24 * 40
    assert sorted(set(trace.matmul_dims())) == [16, 24, 40]
    assert trace.host_reads() == []
    views = [op for op in trace.ops if not op.kernel]
    assert views and all(op.bytes == 0 for op in views)   # t() / views launch nothing


def test_host_reads_are_named():
    x = torch.arange(6.0)
    with OpTrace() as trace:
        int(x.sum())
        (x > 2).nonzero()
    assert trace.host_reads() == ["aten._local_scalar_dense", "aten.nonzero"]
