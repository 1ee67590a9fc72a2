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


def test_fake_tensor_trace_counts_cpu_flash_attention_and_skips_metadata():
    """Under FakeTensorMode (a real shape, no memory) SDPA on a CPU device runs the CPU
    flash kernels, which torch's flop_registry leaves out: counted like the GPU ones, and
    the prim.* queries FakeTensorMode answers launch nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    shape = (1, 8, 4096, 128)
    with FakeTensorMode():
        q = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
        with OpTrace() as trace:
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.backward(torch.ones_like(out))
    attention = [op for op in trace.ops if op.is_attention]
    assert [op.causal for op in attention] == [True, True]
    assert sum(op.flops for op in attention) == (sdpa_flop_count(shape, shape, shape)
                                                 + sdpa_backward_flop_count(shape, shape, shape, shape))
    assert not any(op.kernel or op.bytes for op in trace.ops if op.name.startswith("prim."))
