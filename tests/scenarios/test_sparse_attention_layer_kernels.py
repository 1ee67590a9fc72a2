"""Sparse attention's whole Megatron layer: what one forward + backward launches.

At the shapes sparse attention is for (h1024, s16384-32768 on one H200) a layer's host
enqueue (~1.75 ms a pass + ~35 us a kernel, docs/roofline.md) is as long as its GPU
time, so every kernel the LSH core attention adds over dense causal SDPA costs as much
as GPU work. Traced with OpTrace (one gloo rank, Megatron's local spec, bf16), counted,
never timed:

* kernels over the dense layer (16 buckets vs 1 bucket, same layer): 22 before issue
  33's fusing (two hash concatenations and a negation, the rotation drawn by torch in
  the forward, index arithmetic, an argsort for the inverse permutation, a copy of
  [q | k | v]), 10 now (hash copy, matmul, argmax, two sorts, gather, scatter; backward
  gather, concatenation, scatter), the same at s and 2s;
* no host reads in the forward or backward;
* [q | k | v] read from the QKV projection's output in place: no concatenation of
  [s, b, heads, 3 * head_dim] in the forward.
"""
import pytest
import torch

from launch import in_megatron_process

HIDDEN, HEADS, BUCKETS = 64, 4, 16
EXTRA_KERNELS = 10   # measured 10; 22 before (shown failing: see the module docstring)


def _layer(args, buckets: int):
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.sparse_attention.layer import lsh_attention_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = lsh_attention_spec(layer_spec("local"), seed=1, initial_buckets={1: buckets}, hashes=1)
    layer = build_module(spec, config=cfg, layer_number=1).to(torch.bfloat16)
    layer.self_attention.core_attention.begin_iteration(1)
    return layer


def _trace(layer, s: int):
    """(OpTrace of the forward, OpTrace of the backward) of one micro-batch."""
    from dynmo_plugin.profiling.op_trace import OpTrace
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(s, 1, HIDDEN, generator=gen).to(torch.bfloat16).requires_grad_(True)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    layer(hidden_states=x, attention_mask=mask)  # the mask's causality is checked once per mask
    with OpTrace() as forward:
        out, _ = layer(hidden_states=x, attention_mask=mask)
    with OpTrace() as backward:
        out.float().sum().backward()
    return forward, backward


def _check(args):
    extra = {}
    for s in (1024, 2048):
        (dense_f, dense_b), (lsh_f, lsh_b) = (_trace(_layer(args, b), s) for b in (1, BUCKETS))
        extra[s] = lsh_f.kernels() + lsh_b.kernels() - dense_f.kernels() - dense_b.kernels()
        assert lsh_f.host_reads() == lsh_b.host_reads() == [], (lsh_f.host_reads(), lsh_b.host_reads())
        qkv_copies = [op.name for op in lsh_f.ops if op.kernel and op.outputs
                      and op.outputs[0][-1] == 3 * HIDDEN // HEADS and op.name != "aten.gather"]
        assert qkv_copies == [], qkv_copies
    print(f"kernels over the dense layer: {extra}")
    assert extra[1024] == extra[2048] <= EXTRA_KERNELS, extra


@pytest.mark.multiproc
def test_lsh_layer_adds_few_kernels_over_dense():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check, ModelArgs(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          seq_length=2048, micro_batch_size=1, bf16=True))
