"""What a GPU would pay for Mixture of Depths and MoE layers, counted on the CPU.

One forward + backward of each layer in bf16 under `OpTrace` (every aten op: shapes,
FLOPs, kernels, host reads). No timing: the counts are facts of the code.

Budgets (../shared/notes/h200-acceptance-1.md: MoD at capacity 0.125 measured 0.801x on
an H200, host-bound; MoE crashed without Transformer Engine):
* MoD, capacity 0.125 (64 of 512 tokens): the routed layer's FLOPs <= 0.2x a PLAIN
  TransformerLayer's, and it dispatches at most MOD_EXTRA_KERNELS = 48 kernels more than
  that plain layer over forward + backward (router GEMV, top-k, sort, three gathers, the
  mask index, the gated scatter_add, the predictor and its BCE gradient, and their
  backward: 46 counted after this change; 69 before it, with the float64 statistics
  and the BCE forward in every forward). No host read in either.
* MoD's chosen token count is a multiple of the granularity (64) and every matmul
  dimension is a multiple of 8, except the single output column of the router's and the
  predictor's last linear (matrix-vector products, which run memory-bound kernels that
  have no tile to align).
* MoE at capacity factor 0.5 does <= 0.8x the expert FLOPs of capacity 1.0; the expert
  capacity is a multiple of the granularity (64); every matmul dimension is a multiple
  of 8 except the per-expert token counts, which routing decides (a GEMM's rows, not a
  leading dimension). Host reads: none (padded to the capacity; unpadded, Megatron's
  allgather dispatcher reads two `masked_select`s).
* MoE forward + backward with the local layers and the Transformer Engine names unbound,
  as on a CUDA machine without TE: a NameError without `bind_missing_te_names`, a
  trained step with it.
"""
import pytest
import torch

from launch import in_megatron_process

MOD_EXTRA_KERNELS = 48


def _trace(layer, x, mask):
    """OpTrace of one forward + backward (after a warm-up step, so both layers already
    hold gradients and accumulate alike)."""
    from dynmo_plugin.profiling.op_trace import OpTrace
    for traced in (False, True):
        inp = x.detach().requires_grad_(True)
        if traced:
            with OpTrace() as trace:
                layer(hidden_states=inp, attention_mask=mask)[0].float().sum().backward()
            return trace
        layer(hidden_states=inp, attention_mask=mask)[0].float().sum().backward()


def _initialised(layer):
    """The layer with seeded weights (the launcher's config leaves initialisation to
    init_by_global_name): matrices N(0, 0.02), norm weights 1, biases 0."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
    return layer


def _unaligned(trace, allowed=()) -> list:
    """(op, input shapes) of every matmul with a dimension not a multiple of 8 and not in
    `allowed`."""
    return [(op.name, op.inputs) for op in trace.matmuls()
            if any(d % 8 and d not in allowed for shape in op.inputs for d in shape[-2:])]


# ---- Mixture of Depths -------------------------------------------------------------------------
def _mod_layers(args, capacity: float):
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = mod_spec(layer_spec("local"), {2: capacity}, args.hidden_size // 8, granularity=64)
    plain, routed = (_initialised(build_module(spec, config=cfg, layer_number=n).to(torch.bfloat16))
                     for n in (1, 2))
    routed.mod_context = ModContext(predictor_loss_weight=0.01, grad_scale=1.0)
    return plain, routed


def _check_mod(args):
    s, b, h = args.seq_length, 2, args.hidden_size
    x = torch.randn(s, b, h, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    plain, routed = _mod_layers(args, 0.125)
    base, mod = _trace(plain, x, mask), _trace(routed, x, mask)
    assert routed.tokens(s) == 64
    print(f"MoD 0.125: FLOPs {mod.flops() / base.flops():.3f}x of a plain layer; kernels "
          f"{mod.kernels()} vs plain {base.kernels()}")
    assert mod.flops() <= 0.2 * base.flops(), (mod.flops() / base.flops())
    assert mod.kernels() <= base.kernels() + MOD_EXTRA_KERNELS, (mod.kernels(), base.kernels())
    assert base.host_reads() == [] and mod.host_reads() == []
    # a capacity whose raw token count is no multiple of 8 (0.3 x 512 = 153.6)
    _, odd = _mod_layers(args, 0.3)
    trace = _trace(odd, x, mask)
    assert odd.tokens(s) % 64 == 0, odd.tokens(s)
    assert _unaligned(trace, allowed=(1,)) == []
    # the 1s are the router's and the predictor's single column: 3 GEMVs each (fwd, 2 bwd)
    assert len(_unaligned(trace)) == 6, _unaligned(trace)
    assert trace.host_reads() == []


@pytest.mark.multiproc
def test_routed_mod_layer_costs_what_its_capacity_says():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_mod, ModelArgs(num_layers=2, hidden_size=256, num_attention_heads=4,
                                              seq_length=512, bf16=True))


# ---- Mixture of Experts ---------------------------------------------------------------------------
def _moe_layer(args, capacity_factor: float):
    """Megatron's MoE layer (local spec, 8 experts, top-2) as the MoE scenario builds it,
    and the scenario (its chosen expert capacity)."""
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.config import DynamismConfig
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.moe.live import MixtureOfExperts
    settings = DynamismConfig(kind="moe")
    settings.moe.num_experts, settings.moe.top_k, settings.moe.every = 8, 2, 1
    settings.moe.capacity_factor, settings.moe.granularity = capacity_factor, 64
    scenario = MixtureOfExperts(settings)
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = scenario.layer_spec(layer_spec("local"), args)
    scenario.configure_model(cfg)
    layer = _initialised(build_module(spec, config=cfg, layer_number=1).to(torch.bfloat16))
    return layer, scenario


def _expert_flops(trace, ffn: int) -> int:
    return sum(op.flops for op in trace.matmuls() if any(ffn in shape for shape in op.inputs))


def _check_moe_without_te(args):
    from megatron.core.transformer.moe import moe_utils

    from dynmo_plugin.megatron.training.te_names import bind_missing_te_names
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    x = torch.randn(s, b, h, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    # as on a CUDA machine without Transformer Engine (the CPU layer had bound it)
    del moe_utils.te_general_gemm
    layer, _ = _moe_layer(args, 0.5)       # the scenario's layer_spec binds the name again
    del moe_utils.te_general_gemm          # so unbind it for the failure we guard against
    with pytest.raises(NameError, match="te_general_gemm"):
        layer(hidden_states=x.detach().requires_grad_(True), attention_mask=mask)
    assert bind_missing_te_names() == ["megatron.core.transformer.moe.moe_utils.te_general_gemm"]
    assert bind_missing_te_names() == []   # idempotent

    traces, capacity = {}, {}
    print("MoE kernels, host reads at capacity factor:", end=" ")
    for factor in (1.0, 0.5, 0.45):  # 0.45: a fair share of 57.6 tokens, no multiple of 8
        layer, scenario = _moe_layer(args, factor)
        traces[factor] = _trace(layer, x, mask)
        capacity[factor] = scenario.capacity
        assert layer.mlp.router.weight.grad is not None and layer.mlp.router.weight.grad.abs().sum() > 0
        print(factor, traces[factor].kernels(), len(traces[factor].host_reads()), end="; ")
        # padded: the scheme's CapacityDispatcher picks rows by index (Megatron's allgather
        # dispatcher, unpadded, selects them by masks: two `masked_select`s)
        assert traces[factor].host_reads() == []
        counts = layer.take_counts()   # per expert, both steps: the GEMMs' rows
        assert max(counts) <= 2 * scenario.capacity
        rows = {d for op in traces[factor].matmuls() for shape in op.inputs for d in shape if d % 8}
        assert _unaligned(traces[factor], allowed=rows) == []
        assert rows <= set(range(scenario.capacity + 1)), rows   # only expert token counts
    assert capacity == {1.0: 128, 0.5: 64, 0.45: 64}   # 512 tokens x top-2 / 8 experts x factor
    assert all(c % 64 == 0 for c in capacity.values())
    ffn = args.ffn_hidden_size
    ratio = _expert_flops(traces[0.5], ffn) / _expert_flops(traces[1.0], ffn)
    print(f"expert FLOPs 0.5 / 1.0: {ratio:.3f}")
    assert 0 < ratio <= 0.8, ratio


@pytest.mark.multiproc
def test_moe_trains_without_transformer_engine_at_its_capacity():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_moe_without_te, ModelArgs(
        num_layers=2, hidden_size=64, ffn_hidden_size=192, num_attention_heads=4,
        seq_length=128, micro_batch_size=4, bf16=True))

