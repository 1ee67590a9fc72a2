"""`--attention-backend sdpa`: the local spec's core attention through torch SDPA gives
DotProductAttention's numbers (forward and every gradient), with the plain causal mask,
with a gathered mask as early exit and Mixture of Depths build them, and with grouped
keys/values; the spec swap touches only DotProductAttention; a launcher run trains."""
import functools

import pytest
import torch

from launch import in_megatron_process


def _layers(cfg, spec_a, spec_b, number=2):
    from megatron.core.transformer.spec_utils import build_module
    a = build_module(spec_a, config=cfg, layer_number=number)
    b = build_module(spec_b, config=cfg, layer_number=number)
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    b.load_state_dict(a.state_dict())
    return a, b


def _grads(layer, x, mask):
    x = x.detach().clone().requires_grad_()
    out, _ = layer(hidden_states=x, attention_mask=mask)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out, x.grad] + [p.grad for p in layer.parameters()]


def _check_equal(groups, args):
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.attention.sdpa import SDPACoreAttention, sdpa_attention_spec
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.early_exit.layer import _gather_mask
    from dynmo_plugin.scenarios.gathered_tokens import gather_mask

    torch.manual_seed(0)
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    if groups:  # grouped-query attention: fewer key/value heads than query heads
        cfg.num_query_groups = groups
    unfused, sdpa = layer_spec("local"), layer_spec("local", "sdpa")
    assert sdpa.submodules.self_attention.submodules.core_attention is SDPACoreAttention
    assert unfused.submodules.self_attention.submodules.core_attention.__name__ == "DotProductAttention"
    assert sdpa_attention_spec(sdpa) is sdpa  # not DotProductAttention: left alone
    a, b = _layers(cfg, unfused, sdpa)
    s, batch = args.seq_length, 2
    x = torch.randn(s, batch, args.hidden_size)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    idx = torch.tensor([[0, 1], [2, 3], [5, 4], [7, 9], [11, 12], [13, 15]])   # [C, b] kept tokens
    valid = torch.tensor([[True, True]] * 5 + [[True, False]])
    cases = {"causal": (x, causal), "MoD gathered": (x[:6], gather_mask(causal, idx, s, "t")),
             "early exit gathered": (x[:6], _gather_mask(causal, idx, valid, s))}
    for name, (xs, mask) in cases.items():
        for ga, gb in zip(_grads(a, xs, mask), _grads(b, xs, mask)):
            assert torch.allclose(ga, gb, atol=1e-5, rtol=1e-4), (name, (ga - gb).abs().max().item(), ga.abs().max().item())
        a.zero_grad(), b.zero_grad()


@pytest.mark.parametrize("groups", [None, 2])
def test_sdpa_core_attention_equals_dot_product_attention(groups):
    in_megatron_process(functools.partial(_check_equal, groups))
