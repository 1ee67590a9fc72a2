"""An MoE layer's expert work is what its capacity says, whatever the router does.

On an H200 (scripts/layer_probe.py, bf16, no TE) the MoE layer at capacity factor 0.5
cost 0.926x of capacity 1.0, not ~0.6x, and at 1.0 about as much as a plain dense layer:
its untrained router sent most tokens to a few experts, so at capacity 1.0 the experts
computed a fraction of their 2 x tokens rows (the narrow roofline trace: 2296 of 4096,
per expert 77..512) and halving the capacity trimmed only the overloaded ones (1579
rows, 0.69x). Padding every expert to its capacity (Megatron's
moe_pad_expert_input_to_capacity, the scheme's default) makes the expert GEMMs' rows
exactly the capacity: static shapes, a multiple of the granularity, FLOPs proportional
to the capacity.

The router here sees hidden states with a shared direction (real models' hidden states
have such outlier directions; an untrained router turns it into a preference for a few
experts), one forward + backward of the MoE MLP alone under `OpTrace`, bf16. Counted,
never timed.
"""
import pytest
import torch

from launch import in_megatron_process

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 512, 64, 128, 8, 2


def _moe_mlp(args, capacity_factor: float, pad: bool):
    """The MoE scenario's MLP (local spec) as it configures it, weights initialised."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import DynamismConfig
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.moe.live import MixtureOfExperts
    settings = DynamismConfig(kind="moe")
    m = settings.moe
    m.num_experts, m.top_k, m.every, m.capacity_factor, m.no_pad = EXPERTS, TOP_K, 1, capacity_factor, not pad
    scenario = MixtureOfExperts(settings)
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = scenario.layer_spec(layer_spec("local"), args)
    scenario.configure_model(cfg)
    layer = build_module(spec, config=cfg, layer_number=1).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 if p.dim() > 1
                    else torch.full(p.shape, 1.0 if name.endswith("weight") else 0.0))
    return layer, scenario


def _hidden() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randn(HIDDEN, generator=gen)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=gen) + 1.5 * shared
    return x.to(torch.bfloat16)


def _trace(layer):
    from dynmo_plugin.profiling.op_trace import OpTrace
    x = _hidden().requires_grad_(True)
    with OpTrace() as trace:
        out, _ = layer.mlp(x)
        out.float().sum().backward()
    return trace


def _expert_matmuls(trace):
    return [op for op in trace.matmuls() if any(FFN in shape for shape in op.inputs)]


def _expert_rows(trace) -> list[int]:
    """Tokens (rows) of each expert's fc1 forward GEMM: [rows, hidden] x [hidden, ffn]
    per expert (Megatron's SequentialMLP, unpadded), or one [experts, rows, hidden] x
    [experts, hidden, ffn] batched product (the scheme's GroupedExperts, padded); the
    first such products (the forward runs before the backward)."""
    rows = []
    for op in _expert_matmuls(trace):
        if op.inputs[0][1:] == (HIDDEN,) and op.inputs[1] == (HIDDEN, FFN):
            rows.append(op.inputs[0][0])
        elif op.inputs[0][2:] == (HIDDEN,) and op.inputs[1] == (EXPERTS, HIDDEN, FFN):
            rows += [op.inputs[0][1]] * op.inputs[0][0]
    return rows[:EXPERTS]


def _check(args, pad: bool):
    traces, capacity = {}, {}
    for factor in (1.0, 0.5):
        layer, scenario = _moe_mlp(args, factor, pad)
        traces[factor], capacity[factor] = _trace(layer), scenario.capacity
    assert capacity == {1.0: TOKENS * TOP_K // EXPERTS, 0.5: TOKENS * TOP_K // EXPERTS // 2}
    flops = {f: sum(op.flops for op in _expert_matmuls(t)) for f, t in traces.items()}
    rows = {f: _expert_rows(t) for f, t in traces.items()}
    ratio = flops[0.5] / flops[1.0]
    print(f"pad={pad}: expert rows {rows}, expert GEMM FLOPs 0.5 / 1.0 = {ratio:.3f}")
    # capacity 1.0 computes every expert's full capacity: 2 x the tokens through the FFN
    assert rows[1.0] == [capacity[1.0]] * EXPERTS, rows
    # and capacity 0.5 half of it: rows exactly the capacity, a multiple of the granularity
    assert rows[0.5] == [capacity[0.5]] * EXPERTS, rows
    assert ratio <= 0.55, ratio
    # nothing of the MoE MLP is quadratic in the tokens (a [tokens x tokens] tensor)
    for t in traces.values():
        quadratic = [(op.name, shape) for op in t.ops for shape in op.inputs + op.outputs
                     if sum(d >= TOKENS for d in shape) >= 2]
        assert quadratic == [], quadratic[:3]


def _check_attention_follows_the_dense_spec(args):
    """An MoE layer's attention is the dense spec's, even as edited after the scenario
    made its spec (the trainer swaps in VarlenCoreAttention for packed documents; a
    fused core attention would come the same way); its MLP is Megatron's MoE layer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.attention.varlen import VarlenCoreAttention, varlen_attention_spec
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.moe.layer import moe_layer_spec
    from dynmo_plugin.scenarios.moe.live import _moe_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size = EXPERTS, TOP_K, FFN
    cfg.moe_token_dispatcher_type, cfg.add_bias_linear = "allgather", False
    base = layer_spec("local")
    spec = varlen_attention_spec(moe_layer_spec(base, _moe_spec(base, EXPERTS), (1,)))
    moe, dense = (build_module(spec, config=cfg, layer_number=n) for n in (1, 2))
    assert isinstance(moe.mlp, MoELayer) and not isinstance(dense.mlp, MoELayer)
    for layer in (moe, dense):
        assert isinstance(layer.self_attention.core_attention, VarlenCoreAttention), \
            type(layer.self_attention.core_attention)


def _check_padded(args):
    _check(args, pad=True)
    _check_attention_follows_the_dense_spec(args)


def _args():
    from dynmo_plugin.config import ModelArgs
    return ModelArgs(num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4,
                     seq_length=TOKENS, micro_batch_size=1, bf16=True)


@pytest.mark.multiproc
def test_moe_expert_work_follows_the_capacity():
    """Also: an MoE layer's attention is the dense spec's (`_check_attention_...`)."""
    in_megatron_process(_check_padded, _args())
