"""Structured pruning of whole attention heads that physically shrinks (issue 24).

`--dynmo-pruning-heads F` (structured only, opt-in) removes floor(F_t * heads) heads of
every layer on the sparsity's cubic schedule, the lowest by the L2 norm of their qkv rows
and proj columns, and the shrink rebuilds linear_qkv / linear_proj (weights, gradients,
DDP buffers, masters, Adam moments) with the kept heads only, as the FFN neuron path does
(tests/scenarios/test_physical_pruning.py).
"""
import math

import pytest
import torch

from launch import ROOT, in_megatron_process, losses, worker
from test_physical_pruning import _params
from test_scenario_pruning import _fwd_bwd, seeded_layer  # one layer: shared helpers

HIDDEN, HEADS, HEAD_DIM = 32, 4, 8
QKV, PROJ = "self_attention.linear_qkv", "self_attention.linear_proj"


# ---- one process: the module ---------------------------------------------------------------
def test_head_shrunk_layer_equals_head_masked_layer_and_loads_into_a_fresh_one():
    in_megatron_process(_check_head_shrunk_layer)


def _check_head_shrunk_layer(args):
    """Heads 1 and 3 of 4 pruned. The layer rebuilt from `shrunk_tensors` (what a round
    does) gives the head-masked layer's output, input gradient and kept gradients bit for
    bit; both equal, to 1e-6, an unpruned-spec layer whose pruned heads' qkv rows and
    proj columns are zero (a head with zero q, k, v contributes nothing); a fresh full
    width layer loading the shrunk state takes its two heads and gives the same output."""

    from dynmo_plugin.scenarios.gradual_pruning.live import shrunk_tensors
    from dynmo_plugin.scenarios.gradual_pruning.kernels import apply_mask_
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.gradual_pruning.layer import head_prunable_layer_spec, neuron_prunable_layer_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    plain_spec = neuron_prunable_layer_spec(layer_spec())
    spec = head_prunable_layer_spec(plain_spec)

    def build(s=spec):
        return seeded_layer(s, cfg)

    keep = torch.tensor([True, False, True, False])
    rows, cols = keep.repeat_interleave(3 * HEAD_DIM), keep.repeat_interleave(HEAD_DIM)
    masked, plain = build(), build(plain_spec)
    for layer in (masked, plain):
        qkv, proj = layer.self_attention.linear_qkv, layer.self_attention.linear_proj
        with torch.no_grad():
            apply_mask_(qkv.weight, rows[:, None].expand_as(qkv.weight))
            apply_mask_(qkv.bias, rows)
            apply_mask_(proj.weight, cols[None, :].expand_as(proj.weight))
            if layer is masked:
                qkv.weight_mask &= rows[:, None]
                proj.weight_mask &= cols[None, :]
    assert torch.equal(masked.self_attention.kept_heads(), keep)
    tensors = shrunk_tensors(masked, carried_state(masked))
    physical = build()
    physical.load_state_dict(loadable_state(tensors), strict=True)
    p_qkv, p_proj = physical.self_attention.linear_qkv, physical.self_attention.linear_proj
    assert p_qkv.weight.shape == (2 * 3 * HEAD_DIM, HIDDEN) and p_qkv.bias.shape == (48,)
    assert p_proj.weight.shape == (HIDDEN, 2 * HEAD_DIM)
    assert p_qkv.weight_mask.shape == (3 * HIDDEN, HIDDEN)  # masks stay full width
    x = torch.randn(16, 2, HIDDEN, generator=torch.Generator().manual_seed(0))
    out_m, gx_m, g_m = _fwd_bwd(masked, x)
    out_p, gx_p, g_p = _fwd_bwd(physical, x)
    assert physical.self_attention.num_attention_heads_per_partition == 2
    assert physical.self_attention.core_attention.hidden_size_per_partition == 2 * HEAD_DIM
    assert torch.equal(out_p, out_m) and torch.equal(gx_p, gx_m)
    assert torch.equal(g_p[QKV + ".weight"], g_m[QKV + ".weight"][rows])
    assert torch.equal(g_p[QKV + ".bias"], g_m[QKV + ".bias"][rows])
    assert torch.equal(g_p[PROJ + ".weight"], g_m[PROJ + ".weight"][:, cols])
    assert not g_m[QKV + ".weight"][~rows].any() and not g_m[PROJ + ".weight"][:, ~cols].any()
    out_z, gx_z, _ = _fwd_bwd(plain, x)  # 4 heads, two of them all zero
    torch.testing.assert_close(out_p, out_z, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx_p, gx_z, rtol=1e-6, atol=1e-6)
    assert shrunk_tensors(physical, carried_state(physical)) is None  # nothing left to drop
    again = build()  # a migration's receiver: built with 4 heads from the spec
    again.load_state_dict(physical.state_dict(), strict=True)
    assert torch.equal(_fwd_bwd(again, x)[0], out_p)
    assert again.self_attention.linear_qkv.weight.shape == p_qkv.weight.shape


def test_head_pruning_refuses_grouped_query_attention():
    in_megatron_process(_check_refuses_gqa)


def _check_refuses_gqa(args):
    import dataclasses

    from dynmo_plugin.config import ConfigError
    from dynmo_plugin.scenarios.gradual_pruning.live import _check_head_pruning
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import transformer_config
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    _check_head_pruning(True, cfg)  # standard multi-head attention: fine
    with pytest.raises(ConfigError, match="grouped-query attention"):
        _check_head_pruning(True, dataclasses.replace(cfg, num_query_groups=2))
    with pytest.raises(ConfigError, match="granularity: structured"):
        _check_head_pruning(False, cfg)


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_heads_out_of_range_is_one_line_naming_the_key(value):
    import argparse

    from dynmo_plugin.config import ConfigError, add_dynmo_args, add_model_args
    from dynmo_plugin.megatron.training.machine import load_run_config
    parser = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    args = parser.parse_args(["--dynmo-config", str(ROOT / "configs" / "gradual_pruning.yaml"),
                              "--dynmo-pruning-heads", value])
    with pytest.raises(ConfigError, match=r"dynamism\.pruning\.heads: expected a number in \[0, 1\)"):
        load_run_config(args, world_size=2)
    assert load_run_config(parser.parse_args([]), world_size=1).dynmo.dynamism.pruning.heads == 0.0


# ---- a real PP=2 run -------------------------------------------------------------------------
SMALL = ["--dynmo", "--dynmo-config", str(ROOT / "configs" / "gradual_pruning.yaml"),
         "--num-layers", "4", "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "9", "--seed", "5",
         "--dynmo-pruning-granularity", "structured", "--dynmo-pruning-final-sparsity", "0.7",
         "--dynmo-pruning-start", "2", "--dynmo-pruning-interval", "3", "--dynmo-pruning-rounds", "2",
         "--pipeline-model-parallel-size", "2", "--test-dump-params",
         "--dynmo-pruning-heads", "0.5",  # rounds at 5 (heads 0.4375: 1 of 4) and 8 (0.5: 2)
         "--dynmo-pruning-width-multiple", "8",  # FFN 128 wide: widths of 8 neurons
         "--dynmo-min-gain", "0"]  # the move back (~14-21% predicted) never waits on the noise floor


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Never moved (uniform balancer) and moved: layer 2, head-pruned and shrunk at
    iteration 5, forced from stage 0 to stage 1 at iteration 6 (Et|tttL); the uniform
    balancer, profiling after the round, moves it back at iteration 7 (Ett|ttL)."""
    out = {}
    for name, extra in (("still", []), ("moved", ["--dynmo-forced-layouts", "6:Et|tttL"])):
        d = tmp_path_factory.mktemp(name)
        out[name] = worker(2, SMALL + ["--dynmo-balancer", "uniform"] + extra, d), _params(d)
    return out


@pytest.mark.multiproc
def test_pp2_run_prunes_heads_shrinks_and_trains_on(runs):
    report, params = runs["still"]
    events = [e for e in report["events"] if e["kind"] == "dynamism"]
    assert [(e["iteration"], e["detail"]["heads"]) for e in events] == [(5, 0.4375), (8, 0.5)]
    assert [e["detail"]["attention_heads"] for e in events] == [{str(n): k for n in range(1, 5)}
                                                                for k in (3, 2)]
    assert all(math.isfinite(v) for v in losses(report)) and len(losses(report)) == 9
    for layer in range(4):
        prefix = f"decoder.layers.{layer}."
        kept = HEADS // 2
        assert params[prefix + QKV + ".weight"].shape == (kept * 3 * HEAD_DIM, HIDDEN)
        assert params[prefix + QKV + ".bias"].shape == (kept * 3 * HEAD_DIM,)
        assert params[prefix + PROJ + ".weight"].shape == (HIDDEN, kept * HEAD_DIM)
        neurons = round((1 - events[-1]["detail"]["sparsity"][str(layer + 1)]) * 4 * HIDDEN)
        assert params[prefix + "mlp.linear_fc1.weight"].shape == (neurons, HIDDEN)
        assert neurons == events[-1]["detail"]["ffn_width"][str(layer + 1)] and neurons % 8 == 0


@pytest.mark.multiproc
def test_migrated_head_pruned_layer_equals_never_moved(runs):
    (moved, mp), (still, sp) = runs["moved"], runs["still"]
    applied = [(e["iteration"], e.get("trigger")) for e in moved["events"] if e.get("applied")]
    assert applied == [(6, "forced"), (7, "event:gradual_pruning@5")]
    assert not [e for e in still["events"] if e.get("applied")]
    assert losses(moved) == losses(still)  # tolerance 0
    assert mp.keys() == sp.keys()
    assert [k for k in mp if not torch.equal(mp[k], sp[k])] == []


@pytest.mark.multiproc
def test_checkpoint_after_head_shrink_is_full_width_and_resumes_under_another_layout(tmp_path):
    """Saved by PP=2 (Ett|ttL) after the iteration-5 round shrank one head of each layer:
    qkv / proj stored at full width, zeros at the pruned head. Resumed at iteration 6
    under Et|tttL (layers loaded full width, shrunk again after their first step), the
    losses and the final checkpoint (weights, Adam state) equal the uninterrupted run's
    to the bit."""
    import shutil

    from dynmo_plugin.megatron.checkpoint.dist_ckpt import read_tensors
    flags = SMALL + ["--dynmo-balancer", "uniform", "--save-interval", "3"]
    first = worker(2, flags + ["--save", str(tmp_path / "a")], tmp_path / "a")
    saved = read_tensors(str(tmp_path / "a" / "iter_0000006"))
    qkv = saved["decoder.layers." + QKV + ".weight"]
    assert qkv.shape == (4, 3 * HIDDEN, HIDDEN)  # full width in the checkpoint ...
    pruned = (qkv.view(4, HEADS, 3 * HEAD_DIM, HIDDEN) == 0).all(dim=(2, 3))
    assert pruned.sum(dim=1).tolist() == [1, 1, 1, 1]  # ... zeros at each layer's pruned head
    proj = saved["decoder.layers." + PROJ + ".weight"].view(4, HIDDEN, HEADS, HEAD_DIM)
    assert torch.equal((proj == 0).all(dim=(1, 3)), pruned)
    root = tmp_path / "load"
    shutil.copytree(tmp_path / "a" / "iter_0000006", root / "iter_0000006")
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    resumed = worker(2, flags + ["--pipeline-model-parallel-layout", "Et|tttL", "--load", str(root),
                                 "--save", str(tmp_path / "b")], tmp_path / "b")
    assert losses(resumed) == losses(first)[6:]
    a, b = (read_tensors(str(tmp_path / d / "iter_0000009")) for d in ("a", "b"))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
