"""Structured pruning at widths the GPU runs fast, removing what magnitude says (issues
33 and 40).

A global magnitude threshold at 67% leaves each layer an arbitrary number of FFN neurons
(e.g. 338 of 1024); a bf16 GEMM at such a width falls to slow kernels (an H200 ran an FFN
at width 2703 1.956x the dense one, at 2688 0.49x: ../shared/notes/h200-acceptance-1.md).
Each layer now keeps its count rounded to the nearest `width_multiple` (128 here).

* One bf16 forward + backward of a layer pruned by a round and physically shrunk: every
  matmul dimension a multiple of 8, every kept FFN width a multiple of 128, and the
  MLP's FLOPs at most 0.5x of the dense MLP's (OpTrace).
* Which neurons and heads go, against a brute-force choice computed independently here:
  every neuron's L2 norm (fc1 row, bias, fc2 column) in float64 by a loop, the global
  k-th largest, each layer's count over it rounded to 128, its top neurons; every head's
  norm over its q, k, v rows, biases and proj columns, the lowest floor(0.5 * heads) gone.
  Heads are scaled so that the weakest are neither the first nor the last by index.
"""
import math

import torch

from dynmo_plugin.config import ModelArgs
from launch import in_megatron_process

HIDDEN, HEADS, FFN, S, B = 256, 4, 1024, 64, 2
HEAD_DIM = HIDDEN // HEADS
MULTIPLE, PRUNED, HEAD_FRACTION = 128, 0.67, 0.5
HEAD_SCALES = (1.0, 0.3, 1.2, 0.5)  # heads 1 and 3 are the weakest


def test_pruned_layers_run_aligned_widths_chosen_by_magnitude():
    in_megatron_process(_check, ModelArgs(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          seq_length=S))


def _build(spec, cfg, seed):
    from megatron.core.transformer.spec_utils import build_module
    layer = build_module(spec, config=cfg, layer_number=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        qkv, proj = layer.self_attention.linear_qkv, layer.self_attention.linear_proj
        for head, scale in enumerate(HEAD_SCALES):
            qkv.weight[head * 3 * HEAD_DIM:(head + 1) * 3 * HEAD_DIM] *= scale
            proj.weight[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] *= scale
    return layer


def _expected_neurons(layers) -> list[torch.Tensor]:
    """The brute-force choice: global top-k neuron norms, each layer's count rounded."""
    norms = []
    for layer in layers:
        fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
        w1, b1, w2 = fc1.weight.double(), fc1.bias.double(), fc2.weight.double()
        norms.append(torch.tensor([math.sqrt(float((w1[j] ** 2).sum() + b1[j] ** 2 + (w2[:, j] ** 2).sum()))
                                   for j in range(FFN)], dtype=torch.float64))
    everything = sorted(torch.cat(norms).tolist(), reverse=True)
    tau = everything[math.ceil((1 - PRUNED) * len(everything)) - 1]
    out = []
    for n in norms:
        above = int((n >= tau).sum())
        width = max(MULTIPLE, min(FFN, MULTIPLE * math.floor(above / MULTIPLE + 0.5)))
        keep = torch.zeros(FFN, dtype=torch.bool)
        keep[n.argsort(descending=True)[:width]] = True
        out.append(keep)
    return out


def _expected_heads(layer) -> torch.Tensor:
    qkv, proj = layer.self_attention.linear_qkv, layer.self_attention.linear_proj
    norms = []
    for head in range(HEADS):
        rows = slice(head * 3 * HEAD_DIM, (head + 1) * 3 * HEAD_DIM)
        cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        norms.append(float((qkv.weight[rows].double() ** 2).sum() + (qkv.bias[rows].double() ** 2).sum()
                           + (proj.weight[:, cols].double() ** 2).sum()))
    keep = torch.ones(HEADS, dtype=torch.bool)
    keep[torch.tensor(norms).argsort()[:int(HEAD_FRACTION * HEADS)]] = False
    return keep


def _round(layers):
    """What a pruning round does on one stage: heads, then the global neuron threshold."""
    from dynmo_plugin.scenarios.gradual_pruning.kernels import global_threshold, local_candidates, num_to_keep
    from dynmo_plugin.scenarios.gradual_pruning.live import neuron_scores, prune_heads, prune_neurons
    prune_heads([layer.self_attention for layer in layers], None, HEAD_FRACTION)
    scores = [neuron_scores(layer.mlp.linear_fc1, layer.mlp.linear_fc2) for layer in layers]
    total = sum(s.numel() for s in scores)
    tau = global_threshold([local_candidates(scores, num_to_keep(total, PRUNED))], total, PRUNED)
    return prune_neurons([(layer.mlp.linear_fc1, layer.mlp.linear_fc2, s) for layer, s in zip(layers, scores)],
                         None, tau, MULTIPLE)


def _trace(module, x, **kwargs):
    from dynmo_plugin.profiling.op_trace import OpTrace
    x = x.detach().clone().requires_grad_(True)
    with OpTrace() as trace:
        out = module(hidden_states=x, **kwargs) if kwargs else module(x)
        out[0].float().sum().backward()
    return trace


def _check(args):
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.gradual_pruning.layer import head_prunable_layer_spec, neuron_prunable_layer_spec
    from dynmo_plugin.scenarios.gradual_pruning.live import shrunk_tensors
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = head_prunable_layer_spec(neuron_prunable_layer_spec(layer_spec()))
    layers = [_build(spec, cfg, seed) for seed in (1, 2)]
    expected = _expected_neurons(layers), [_expected_heads(layer) for layer in layers]
    widths = _round(layers)
    print(f"kept FFN widths {widths} of {FFN} (multiple {MULTIPLE}), heads "
          f"{[int(layer.self_attention.kept_heads().sum()) for layer in layers]} of {HEADS}")
    for layer, neurons, heads in zip(layers, *expected):
        assert torch.equal(layer.self_attention.kept_heads(), heads)
        assert torch.equal(layer.mlp.linear_fc1.kept_neurons(), neurons)
    assert all(w % MULTIPLE == 0 for w in widths) and widths == [int(n.sum()) for n in expected[0]]

    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    dense = _build(spec, cfg, 1).to(torch.bfloat16)
    for layer in layers:
        shrunk = _build(spec, cfg, 0)  # rebuilt with the kept neurons and heads only
        shrunk.load_state_dict(loadable_state(shrunk_tensors(layer, carried_state(layer))), strict=True)
        shrunk = shrunk.to(torch.bfloat16)
        width = shrunk.mlp.linear_fc1.weight.shape[0]
        assert width % MULTIPLE == 0 and width < FFN
        trace = _trace(shrunk, x, attention_mask=mask)
        odd = sorted({d for d in trace.matmul_dims() if d % 8})
        assert odd == [], f"matmul dimensions not multiples of 8: {odd}"
        assert trace.host_reads() == []  # nothing read back (test_scenario_host_sync: every layer)
        ffn, ffn_dense = _trace(shrunk.mlp, x).flops(), _trace(dense.mlp, x).flops()
        assert ffn <= 0.5 * ffn_dense, (ffn, ffn_dense)


def test_head_counts_keep_projection_widths_multiples_of_8():
    """Whole heads; where head_dim is no multiple of 8 the kept count rounds up so that
    count * head_dim is (the full count always allowed), never above the heads kept now."""
    from dynmo_plugin.scenarios.gradual_pruning.widths import kept_head_count
    assert kept_head_count(8, 8, 0.375, 64) == 5   # head_dim 64: any count
    assert kept_head_count(8, 8, 0.375, 4) == 6    # 5 heads of 4 = 20 columns: 6 (24)
    assert kept_head_count(6, 6, 0.5, 12) == 4     # 3 x 12 = 36: 4 (48)
    assert kept_head_count(6, 4, 0.9, 12) == 2     # at least one head, rounded: 2
    assert kept_head_count(5, 5, 0.5, 4) == 4 and kept_head_count(5, 5, 0.1, 4) == 5  # the full count
    for heads in range(1, 17):
        for dim in (4, 6, 12, 64, 80):
            for fraction in (0.0, 0.3, 0.5, 0.75, 0.99):
                count = kept_head_count(heads, heads, fraction, dim)
                assert 1 <= count <= heads and (count * dim % 8 == 0 or count == heads)
                assert count >= heads - int(fraction * heads)
