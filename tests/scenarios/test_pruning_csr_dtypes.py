"""Which weights may take the CSR kernel (issue 25 item 6).

`SparseLinearFunction`'s backward calls `torch.sparse.sampled_addmm`, whose input check
(shared by the CPU and CUDA kernels in torch 2.13) accepts float/double/complex only,
and the CPU forward (MKL) has no bf16/fp16 either. The decision used to say yes for any
CUDA weight, so a bf16 model on a GPU past the sparse threshold raised in its backward.
"""
import pytest
import torch

from dynmo_plugin.scenarios.gradual_pruning.layer import csr_supported


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_half_precision_weights_keep_the_dense_masked_matmul(device):
    assert csr_supported(device, torch.float32) and csr_supported(device, torch.float64)
    assert not csr_supported(device, torch.bfloat16)
    assert not csr_supported(device, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_refuses_half_precision_sampled_addmm(dtype):
    """The fact the decision rests on, as this torch reports it (its message names the
    device-independent input check)."""
    pattern = torch.eye(4, dtype=dtype).to_sparse_csr()
    with pytest.raises(RuntimeError, match="floating-point or complex"):
        torch.sparse.sampled_addmm(pattern, torch.ones(4, 2, dtype=dtype), torch.ones(2, 4, dtype=dtype))
