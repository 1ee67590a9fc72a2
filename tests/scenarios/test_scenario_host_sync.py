"""The scenarios' layers read no device tensor back to the host in a forward + backward.

On a GPU, `bool(t)`, `int(t)`, `float(t)`, `t.item()`, `t.tolist()`, `torch.equal` and
boolean-mask indexing wait until the device has caught up: once per layer and
micro-batch that stalls the host and turns CUDA-event timings into measurements of host
lag. There is no GPU here, so `HostReads` (a TorchFunctionMode, counting only) records
every such call in one forward + backward of each scenario layer built in a real
Megatron process: what a GPU run under `torch.cuda.set_sync_debug_mode("error")` would
refuse. The plain TransformerLayer is the baseline (it reads nothing back either).

Budgets: 0 for every layer but early exit's. Pruned layers (unstructured masks, FFN
neurons and heads, masked or physically shrunk) read their masks back when a mask is
written (construction, `load_state_dict`, a pruning round: outside any forward), never in
one (before issue 33 the first forward after any of those read each linear's mask:
`int(mask.sum())` and `nonzero()`). Early exit reads once per stage and micro-batch (one
`tolist`, in the stage's first layer), and only once tokens may have exited: how many
tokens are still active sizes the gather, and the bound it uses (the count entering the
layer before) comes from the carrier there; the stage's later layers wait for a copy the
layer before staged (docs/scenarios/early_exit.md, "Host synchronisation").
"""
import pytest
import torch
from torch.overrides import TorchFunctionMode

from launch import in_megatron_process

_READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "equal", "nonzero",
          "masked_select", "unique", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Records the name of every call that reads a tensor's value on the host."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if args and getattr(args[0], "_dynmo_host_copy", False):  # a staged host buffer
            return func(*args, **(kwargs or {}))
        if name in _READS or (name in ("__getitem__", "__setitem__") and _bool_index(args[1:2])):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _bool_index(index) -> bool:
    items = index[0] if index and isinstance(index[0], tuple) else index
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)


def _reads(layer, x, **kwargs) -> list[str]:
    with HostReads() as mode:
        out, _ = layer(hidden_states=x, **kwargs)
        out.float().sum().backward()
    return mode.calls


def _base():
    from dynmo_plugin.megatron.training.model import layer_spec
    return layer_spec()


def _check_layers(args):
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.scenarios.early_exit.layer import ExitContext, early_exit_spec, encode_exited
    from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
    from dynmo_plugin.scenarios.sparse_attention.layer import lsh_attention_spec
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config

    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    base = layer_spec()
    s, b, h = args.seq_length, 2, args.hidden_size
    gen = torch.Generator().manual_seed(0)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]

    def build(spec, number=2):
        layer = build_module(spec, config=cfg, layer_number=number)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        return layer

    def hidden(rows=s):
        return torch.randn(rows, b, h, generator=gen, requires_grad=True)

    assert _reads(build(base), hidden(), attention_mask=mask) == []   # the baseline

    frozen = build(freezable_spec(base))
    frozen.set_frozen(True)
    assert _reads(frozen, hidden(), attention_mask=mask) == []

    routed = build(mod_spec(base, {2: 0.5}, 8, granularity=8))  # s16: 64 would route all
    routed.mod_context = ModContext(predictor_loss_weight=1.0, grad_scale=1.0)
    assert _reads(routed, hidden(), attention_mask=mask) == []

    lsh = build(lsh_attention_spec(base, seed=1, initial_buckets={2: 4}, hashes=1))
    lsh.self_attention.core_attention.begin_iteration(1)
    assert _reads(lsh, hidden(), attention_mask=mask) == []

    _check_pruned_layers(args, cfg, base, build, hidden, mask)

    exiting = build(early_exit_spec(base, vocab_size=args.vocab_size), number=3)
    labels = torch.randint(args.vocab_size, (s, b), generator=gen)
    exited = torch.zeros(s, b, dtype=torch.bool)
    exited[s // 2:, 0] = True  # half of sample 0 left at an earlier layer: the gather path
    for exits_on, expected in ((False, []), (True, ["tolist"])):
        exiting.exit_context = ExitContext(seq_length=s, threshold=0.5, min_layer=2,
                                           exits_on=exits_on, loss_weight=0.5, grad_scale=1.0,
                                           labels=[labels], loss_masks=[torch.ones(s, b)])
        exiting.reset_exit_stats()
        x = torch.cat([hidden(), encode_exited(exited if exits_on else exited & False, h,
                                               torch.float32)]).detach().requires_grad_()
        assert _reads(exiting, x, attention_mask=mask) == expected, exits_on
    _check_exit_stage(build, early_exit_spec, ExitContext, encode_exited, exited, labels, hidden, mask, h)


def _check_exit_stage(build, early_exit_spec, ExitContext, encode_exited, exited, labels, hidden, mask, h):
    """A stage's later layers read nothing: layer 4 gathers at most the tokens active
    entering layer 3, which layer 3 staged for the host when it started (StagedCount);
    only the stage's first layer reads (that bound, from the carrier)."""
    s, b = exited.shape
    first, second = (build(early_exit_spec(_base(), vocab_size=labels.max().item() + 1), number=n)
                     for n in (3, 4))
    ctx = ExitContext(seq_length=s, threshold=0.5, min_layer=2, exits_on=True, loss_weight=0.5,
                      grad_scale=1.0, labels=[labels], loss_masks=[torch.ones(s, b)])
    for layer in (first, second):
        layer.exit_context = ctx
        layer.reset_exit_stats()
    x = torch.cat([hidden(), encode_exited(exited, h, torch.float32)]).detach().requires_grad_()
    with HostReads() as mode:
        out, _ = first(hidden_states=x, attention_mask=mask)
    assert mode.calls == ["tolist"]
    assert _reads(second, out.detach().requires_grad_(), attention_mask=mask) == []
    assert second.tokens_active <= first.tokens_active == int((~exited).sum())


def _check_pruned_layers(args, cfg, base, build, hidden, mask):
    """Budget 0: fresh pruned layers, after a round, and physically shrunk."""
    from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
    from dynmo_plugin.scenarios.gradual_pruning.layer import (head_prunable_layer_spec,
                                                              neuron_prunable_layer_spec,
                                                              prunable_layer_spec)
    from dynmo_plugin.scenarios.gradual_pruning.live import (neuron_scores, prune_heads,
                                                             prune_neurons, shrunk_tensors)
    assert _reads(build(prunable_layer_spec(base, 0.85)), hidden(), attention_mask=mask) == []
    spec = head_prunable_layer_spec(neuron_prunable_layer_spec(base))
    assert _reads(build(spec), hidden(), attention_mask=mask) == []
    layer = build(spec)
    fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
    score = neuron_scores(fc1, fc2)
    prune_neurons([(fc1, fc2, score)], None, float(score.median()), 8)  # a round: masked
    prune_heads([layer.self_attention], None, 0.5)
    assert 0 < int(fc1.kept_neurons().sum()) < fc1.full_width
    assert _reads(layer, hidden(), attention_mask=mask) == []
    shrunk = build(spec)  # physically shrunk, as a round's rebuild or a migration loads it
    shrunk.load_state_dict(loadable_state(shrunk_tensors(layer, carried_state(layer))), strict=True)
    assert shrunk.mlp.linear_fc1.weight.shape[0] < fc1.full_width
    assert _reads(shrunk, hidden(), attention_mask=mask) == []


@pytest.mark.multiproc
def test_scenario_layers_read_nothing_back_per_micro_batch():
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_layers, ModelArgs(num_layers=4, hidden_size=32, num_attention_heads=4,
                                                 seq_length=16, vocab_size=32))


def test_varlen_attention_slices_by_the_host_boundaries():
    """Packed documents: the boundaries come with the batch as a host list."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from dynmo_plugin.megatron.attention.varlen import VarlenCoreAttention, packed_seq_params
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            attention_dropout=0.0, hidden_dropout=0.0)
    module = VarlenCoreAttention(cfg, 1, AttnMaskType.causal, "self")
    lengths = [5, 3, 6]
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    params = packed_seq_params({"cu_seqlens": cu, "max_seqlen": 6, "lengths": lengths})
    q, k, v = (torch.randn(16, 4, 8, requires_grad=True) for _ in range(3))
    with HostReads() as mode:
        out = module(q, k, v, None, packed_seq_params=params)
        out.sum().backward()
    assert mode.calls == []
    params.cu_seqlens_host = None  # a caller without the host list: same result, read back
    with HostReads() as mode:
        again = module(q, k, v, None, packed_seq_params=params)
    assert mode.calls == ["tolist"] and torch.equal(out, again)
