"""Mixture of Depths: what a routed layer adds to its block, counted, and that its
hand-written backwards (scenarios/mixture_of_depths/routing.py) give autograd's answer.

Issue 33: a routed layer at capacity 0.125 runs its block on 1/8 of the tokens, so on a
GPU its host enqueue (~35 us per kernel, docs/roofline.md) set its time. Counted here
with `OpTrace`, one forward + backward in bf16 at capacity 0.125 (64 of 512 tokens),
the kernels of the routed layer minus those of a plain TransformerLayer:

* before (autograd routing, the mask gathered and marked arbitrary, AttachBCE): 44 with
  --attention-backend sdpa (17 in the forward, 4 of them turning the gathered mask into
  SDPA's), 40 with the unfused attention (13 in the forward);
* after: 30 with either (9 in the forward: router GEMV, top-k, sort, two gathers, the
  gate's sigmoid, the gated scatter_add's three; the causal mask among tokens kept in
  order is a view).

No host read in the forward. The results are those of the previous implementation's
expressions run by autograd (router Linear, sorted top-C, the mask gathered at the
tokens' original positions, the block, the gated scatter_add, the predictor's mean BCE
loss computed for real), in float64: output and every gradient to 1e-10.
"""
import pytest
import torch

from launch import in_megatron_process

MOD_EXTRA_KERNELS = 30   # forward + backward, was 44 (sdpa) / 40 (unfused)
MOD_EXTRA_FORWARD = 9    # was 17 (sdpa) / 13 (unfused)


def _layers(args, backend: str, dtype, capacity: float = 0.125):
    """(plain layer 1, routed layer 2) of the local spec with `backend` attention, seeded."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = mod_spec(layer_spec("local", backend), {2: capacity}, args.hidden_size // 8, granularity=64)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for n in (1, 2):
        layer = build_module(spec, config=cfg, layer_number=n)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        layers.append(layer.to(dtype))
    layers[1].mod_context = ModContext(predictor_loss_weight=0.5, grad_scale=2.0)
    return layers


def _causal(s: int) -> torch.Tensor:
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]


def _counted(layer, x, mask):
    """(forward trace, backward trace) of one step, gradients starting from None."""
    from dynmo_plugin.profiling.op_trace import OpTrace
    layer.zero_grad(set_to_none=True)
    inp = x.detach().requires_grad_(True)
    with OpTrace() as forward:
        out, _ = layer(hidden_states=inp, attention_mask=mask)
    grad = torch.ones_like(out)
    with OpTrace() as backward:
        out.backward(grad)
    return forward, backward


def _check_kernels(args):
    s, b, h = args.seq_length, 2, args.hidden_size
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for backend in ("sdpa", "unfused"):
        plain, routed = _layers(args, backend, torch.bfloat16)
        assert routed.tokens(s) == 64
        (pf, pb), (mf, mb) = _counted(plain, x, _causal(s)), _counted(routed, x, _causal(s))
        extra_forward = mf.kernels() - pf.kernels()
        extra = extra_forward + mb.kernels() - pb.kernels()
        print(f"{backend}: routed layer {mf.kernels()}+{mb.kernels()} kernels, plain "
              f"{pf.kernels()}+{pb.kernels()}: {extra} extra ({extra_forward} in the forward)")
        assert extra <= MOD_EXTRA_KERNELS, (backend, extra)
        assert extra_forward <= MOD_EXTRA_FORWARD, (backend, extra_forward)
        assert mf.host_reads() == [] and mb.host_reads() == []


@pytest.mark.multiproc
def test_routed_layer_adds_few_kernels_to_its_block():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_kernels, ModelArgs(num_layers=2, hidden_size=256, num_attention_heads=4,
                                                   seq_length=512, bf16=True))


# ---- the same numbers as autograd's ----------------------------------------------------------
def _reference(layer, x, mask, scale: float):
    """The previous implementation's expressions, by autograd: (output, predictor loss)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dynmo_plugin.scenarios.gathered_tokens import gather_mask
    s, b, h = x.shape
    c = layer.tokens(s)
    logits = layer.router(x).squeeze(-1)
    idx = torch.topk(logits.detach(), c, dim=0, sorted=False).indices.sort(dim=0).values
    gate = torch.sigmoid(logits.gather(0, idx))[..., None]
    where = idx[..., None].expand(c, b, h)
    x_sel = x.gather(0, where)
    y_sel, _ = TransformerLayer.forward(layer, hidden_states=x_sel,
                                        attention_mask=gather_mask(mask, idx, s, "reference"))
    out = x.scatter_add(0, where, gate * (y_sel - x_sel))
    target = torch.zeros(s, b, dtype=x.dtype).scatter(0, idx, 1.0)
    bce = F.binary_cross_entropy_with_logits(layer.predictor(x.detach()), target)
    return out, scale * bce


def _gradients(layer, x, step):
    layer.zero_grad(set_to_none=True)
    inp = x.detach().requires_grad_(True)
    step(inp).backward()
    return [inp.grad] + [p.grad for p in layer.parameters()]


def _check_autograd(args):
    from dynmo_plugin.scenarios.gathered_tokens import arbitrary_mask
    s, b, h = args.seq_length, 3, args.hidden_size
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    w = torch.randn(s, b, h, generator=gen, dtype=torch.float64)   # upstream gradient
    # the causal mask (a corner of it is the routed tokens') and an arbitrary one (gathered)
    keep = torch.rand(s, s, generator=gen) < 0.7
    other = arbitrary_mask((~(keep | torch.eye(s, dtype=torch.bool)))[None, None])
    for backend in ("sdpa", "unfused"):
        _, routed = _layers(args, backend, torch.float64, capacity=0.25)
        scale = routed.mod_context.grad_scale * routed.mod_context.predictor_loss_weight
        for mask in (_causal(s), other):
            out = routed(hidden_states=x, attention_mask=mask)[0]
            ref = _reference(routed, x, mask, scale)[0]
            assert (out - ref).abs().max() < 1e-12, (backend, (out - ref).abs().max())
            mine = _gradients(routed, x, lambda i: (routed(hidden_states=i, attention_mask=mask)[0] * w).sum())
            theirs = _gradients(routed, x, lambda i: (lambda o, loss: (o * w).sum() + loss)(
                *_reference(routed, i, mask, scale)))
            names = ["x"] + [n for n, _ in routed.named_parameters()]
            for name, a, r in zip(names, mine, theirs):
                assert a is not None and r is not None, name
                err = (a - r).abs().max() / r.abs().max().clamp_min(1e-30)
                assert err < 1e-10, (backend, name, float(err))


@pytest.mark.multiproc
def test_routed_layer_gradients_equal_autograd_of_the_previous_expressions():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_autograd, ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4,
                                                    seq_length=256))
