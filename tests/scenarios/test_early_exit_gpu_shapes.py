"""Early exit's gathered layer: GEMM-friendly token counts, a bounded host cost, and the
right attention (issues 33 and 40).

* Every matmul of one bf16 forward + backward of a layer with exited tokens has
  dimensions that are multiples of 8, and the gathered token count C is the most active
  tokens of any sample rounded up to `token_multiple` (64): C = 37 gives C = 64 (a bf16
  GEMM at an odd size falls to slow kernels: ../shared/notes/h200-acceptance-1.md).
* The padding changes nothing for the active tokens: outputs and input gradients equal
  (bit for bit) those of the same layer gathering exactly C tokens (token_multiple 1,
  the layer before the rounding).
* The gathered attention mask, checked against an independent reference: Megatron's
  plain TransformerLayer forward over all s tokens at their ORIGINAL positions, with
  exited tokens masked as keys, gives the same outputs at the active tokens; an
  all-False gathered mask (active tokens seeing later ones) fails it.
* Operator budget (the host's cost, a launch per kernel): the gathered layer's forward +
  backward dispatches at most EXTRA_KERNELS kernels more than the plain layer's (measured: 75 at this shape). What it
  adds: the exit flags decoded from and encoded into the carrier rows, the sort, gathers
  and scatter of tokens, labels and mask, the gathered mask's build, the exit head
  (LayerNorm, Linear, fp32 cross-entropy, softmax confidence) and the exit decision,
  each with its backward where it has one; none of them grows with s or h.
"""
import torch

from dynmo_plugin.config import ModelArgs
from launch import in_megatron_process

S, B, HIDDEN, HEADS, VOCAB, MULTIPLE = 128, 2, 256, 4, 64, 64
ACTIVE = (37, 21)  # active tokens of each sample before the layer
EXTRA_KERNELS = 80


def test_gathered_layer_shapes_padding_mask_and_operator_budget():
    in_megatron_process(_check, ModelArgs(num_layers=8, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                          seq_length=S, vocab_size=VOCAB))


def _layers(args, dtype):
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.early_exit.layer import early_exit_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    gen = torch.Generator().manual_seed(0)
    out = []
    for spec in (early_exit_spec(layer_spec(), VOCAB), layer_spec()):
        layer = build_module(spec, config=cfg, layer_number=6)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out.append(layer.to(dtype))
    return out


def _inputs(dtype):
    from dynmo_plugin.scenarios.early_exit.layer import encode_exited
    gen = torch.Generator().manual_seed(1)
    exited = torch.ones(S, B, dtype=torch.bool)
    for j, n in enumerate(ACTIVE):
        exited[torch.randperm(S, generator=gen)[:n], j] = False
    x = torch.randn(S, B, HIDDEN, generator=gen).to(dtype)
    return x, exited, torch.cat([x, encode_exited(exited, HIDDEN, dtype)])


def _context(multiple):
    from dynmo_plugin.scenarios.early_exit.layer import ExitContext
    gen = torch.Generator().manual_seed(2)
    return ExitContext(seq_length=S, threshold=0.99, min_layer=4, exits_on=True, loss_weight=0.5,
                       grad_scale=1.0, labels=[torch.randint(VOCAB, (S, B), generator=gen)],
                       loss_masks=[torch.ones(S, B)], token_multiple=multiple)


def _run(layer, hidden, mask, multiple=MULTIPLE):
    """Output rows [:S] and the input gradient of one forward + backward."""
    layer.exit_context = _context(multiple)
    layer.reset_exit_stats()
    hidden = hidden.detach().clone().requires_grad_(True)
    out, _ = layer(hidden_states=hidden, attention_mask=mask)
    (out[:S].float() * torch.linspace(-1, 1, S * B * HIDDEN).view(S, B, HIDDEN)).sum().backward()
    return out[:S].detach(), hidden.grad[:S]


def _causal():
    return torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]


def _check(args):
    _check_mask_against_full_layer(args)
    _check_padding_changes_nothing(args)
    _check_bf16_shapes_and_budget(args)


def _check_bf16_shapes_and_budget(args):
    from dynmo_plugin.profiling.op_trace import OpTrace
    exiting, plain = _layers(args, torch.bfloat16)
    _, _, hidden = _inputs(torch.bfloat16)
    with OpTrace() as trace:
        _run(exiting, hidden, _causal())
    assert exiting.tokens_active == sum(ACTIVE)
    odd = sorted({d for d in trace.matmul_dims() if d % 8})
    assert odd == [], f"matmul dimensions not multiples of 8: {odd}"
    # the attention products [b * heads, C, d] x [b * heads, d, C]: C = 37 rounded up to 64
    queries = {op.inputs[0][1] for op in trace.matmuls()
               if op.name.endswith("bmm") and op.inputs[0][0] == B * HEADS}
    assert queries == {MULTIPLE}, queries
    x = torch.randn(S, B, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with OpTrace() as base:
        out, _ = plain(hidden_states=x, attention_mask=_causal())
        (out.float() * torch.linspace(-1, 1, S * B * HIDDEN).view(S, B, HIDDEN)).sum().backward()
    extra = trace.kernels() - base.kernels()
    print(f"early exit layer: {trace.kernels()} kernels, plain layer {base.kernels()}: +{extra}")
    assert extra <= EXTRA_KERNELS, (trace.kernels(), base.kernels())


def _check_padding_changes_nothing(args):
    exiting, _ = _layers(args, torch.float32)
    _, exited, hidden = _inputs(torch.float32)
    out_64, grad_64 = _run(exiting, hidden, _causal(), MULTIPLE)
    out_1, grad_1 = _run(exiting, hidden, _causal(), 1)  # exactly C = 37 gathered
    active = ~exited
    assert torch.equal(out_64[active], out_1[active])
    assert torch.equal(grad_64[active], grad_1[active])
    assert torch.equal(out_64[exited], hidden[:S][exited])  # exited tokens pass unchanged


def _check_mask_against_full_layer(args):
    from megatron.core.transformer.transformer_layer import TransformerLayer
    exiting, _ = _layers(args, torch.float32)
    x, exited, hidden = _inputs(torch.float32)
    out, _ = _run(exiting, hidden, _causal())
    # the reference: every token at its original position; queries see earlier ACTIVE keys
    reference_mask = _causal() | exited.T[:, None, None, :]  # [b, 1, s, s], True = masked
    with torch.no_grad():
        reference, _ = TransformerLayer.forward(exiting, hidden_states=x, attention_mask=reference_mask)
    active = ~exited
    torch.testing.assert_close(out[active], reference[active], rtol=1e-5, atol=1e-5)
