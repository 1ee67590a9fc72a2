"""Gradual global magnitude pruning in real torchrun runs (2 pipeline stages, gloo).

Two runs of configs/gradual_pruning.yaml with the final sparsity raised to 0.98 (events
at iterations 8, 11, 14; targets 0.690, 0.944, 0.98: at 0.95 a layer measured only
~0.75x dense, too close to a threshold on a shared machine), shared by the tests: a static one (`--dynmo-balancer uniform`,
whose plan is the current split, so nothing moves) and a DynMo one (`exact`, layers
migrate). The vocabulary is raised so that the output layer makes the uniform split
clearly unbalanced and the DynMo run migrates at the first event already.
"""
import json

import pytest
import torch

from launch import ROOT, losses, worker

pytestmark = pytest.mark.multiproc

FLAGS = ["--dynmo", "--dynmo-config", str(ROOT / "configs" / "gradual_pruning.yaml"),
         "--vocab-size", "8192", "--dynmo-profile-every", "4", "--test-dump-params",
         "--dynmo-pruning-final-sparsity", "0.98"]
FINAL = 0.98
LINEARS = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
           "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    return worker(2, FLAGS + ["--dynmo-balancer", "uniform"], out), out


@pytest.fixture(scope="module")
def dynmo(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynmo")
    return worker(2, FLAGS + ["--dynmo-balancer", "exact"], out), out


def _pruning_events(report):
    return [e for e in report["events"] if e["kind"] == "dynamism"]


def _profiles(report):
    """(last iteration of the window, profile) of every closed profiling window."""
    return [(e["window"][1], e["profile"]) for e in report["events"]
            if e["kind"] in ("profile", "rebalance") and e.get("profile")]


def _layer_to_head(profile) -> float:
    """Mean cost of the last stage's layers over that stage's output layer + loss, in
    one window on one rank: a ratio, so machine load during the window cancels out."""
    last = max(s["stage"] for s in profile["stages"])
    head = next(s["extra_s"] for s in profile["stages"] if s["stage"] == last)
    layers = [x["fwd_s"] + x["bwd_s"] for x in profile["layers"] if x["stage"] == last]
    return sum(layers) / len(layers) / head


def test_events_follow_the_cubic_schedule(static):
    report, _ = static
    events = _pruning_events(report)
    assert [e["iteration"] for e in events] == [8, 11, 14]
    targets = [e["detail"]["target"] for e in events]
    assert targets == pytest.approx([FINAL * (1 - (2 / 3) ** 3), FINAL * (1 - (1 / 3) ** 3), FINAL])
    for e in events:
        d = e["detail"]
        assert sorted(int(k) for k in d["sparsity"]) == list(range(1, 9))
        assert d["threshold"] > 0
    assert events[0]["detail"]["sparse_kernel_layers"] == []  # 0.69 < 0.85: dense masked
    assert events[-1]["detail"]["sparse_kernel_layers"] == list(range(1, 9))
    # every event is followed by a rebalance decision with the event as trigger
    triggers = [e["trigger"] for e in report["events"] if e["kind"] == "rebalance"]
    assert triggers == [f"event:gradual_pruning@{i}" for i in (8, 11, 14)]


def test_pruned_layers_run_cheaper_than_dense(static):
    report, _ = static
    profiles = _profiles(report)
    before = [p for end, p in profiles if end < 8]
    after = [p for end, p in profiles if end > 14]
    assert before and after
    ratio = _layer_to_head(after[-1]) / _layer_to_head(before[0])
    assert ratio < 0.8, f"layer cost after pruning to {FINAL} is {ratio:.2f}x the dense cost"


def test_dynmo_losses_equal_static_and_layers_moved(static, dynmo):
    s_report, d_report = static[0], dynmo[0]
    assert losses(d_report) == losses(s_report)  # bit for bit
    applied = [e for e in d_report["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert applied, "the DynMo run never migrated a layer"
    assert d_report["layout"] != d_report["initial_layout"]
    assert not [e for e in s_report["events"] if e["kind"] == "rebalance" and e["applied"]]
    # the same global threshold on both, whatever the split
    for a, b in zip(_pruning_events(s_report), _pruning_events(d_report)):
        assert a["detail"] == b["detail"]


def test_pruned_weights_stay_zero_and_global_sparsity_matches(dynmo):
    report, out = dynmo
    params = {}
    for rank in (0, 1):
        params.update(torch.load(out / f"params_rank{rank}.pt"))
    last = _pruning_events(report)[-1]["detail"]["sparsity"]
    zeros = total = 0
    for layer in range(8):
        z = n = 0
        for leaf in LINEARS:
            w = params[f"decoder.layers.{layer}.{leaf}"]
            z, n = z + int((w == 0).sum()), n + w.numel()
        # three optimizer steps after the last round: still exactly the masked entries
        assert z / n == pytest.approx(last[str(layer + 1)], abs=2e-6)
        zeros, total = zeros + z, total + n
    assert zeros / total == pytest.approx(FINAL, abs=1e-4)
    # biases and norms are not pruned
    bias = params["decoder.layers.0.mlp.linear_fc1.bias"]
    assert (bias != 0).float().mean() > 0.5
    json.dumps(report)  # the report (events included) is plain JSON


# ---- one process: the Megatron modules and the scenario's config checks --------------

@pytest.fixture(scope="module")
def megatron_world():
    import os

    from launch import free_port

    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.megatron.parallel import destroy_parallel, init_parallel
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    args = ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    try:
        init_parallel(args)
        yield args
    finally:
        destroy_parallel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _layer(args, threshold=0.85):
    from megatron.core.transformer.spec_utils import build_module

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.model import layer_spec, transformer_config
    from dynmo_plugin.megatron.prunable import prunable_layer_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    layer = build_module(prunable_layer_spec(layer_spec(), threshold), config=cfg, layer_number=1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():  # the same values in every layer built here
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return layer


def _fwd_bwd(layer, x):
    x = x.clone().requires_grad_(True)
    s = x.shape[0]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s).expand(x.shape[1], 1, s, s)
    out, _ = layer(hidden_states=x, attention_mask=mask)
    layer.zero_grad()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_prunable_layer_masks_travel_in_state_dict_and_kernels_agree(megatron_world):
    from dynmo_plugin.dynamism.pruning import apply_mask_
    from dynmo_plugin.megatron.prunable import prunable_linears
    args = megatron_world
    dense, sparse = _layer(args, threshold=1.0), _layer(args, threshold=0.5)  # never / always CSR
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (_, a), (_, b) in zip(prunable_linears(dense), prunable_linears(sparse)):
            keep = torch.rand(a.weight.shape, generator=gen) >= 0.7
            for m in (a, b):
                m.weight_mask.copy_(keep)
                apply_mask_(m.weight, keep)
    assert [m.uses_sparse_kernel for _, m in prunable_linears(dense)] == [False] * 4
    assert [m.uses_sparse_kernel for _, m in prunable_linears(sparse)] == [True] * 4
    x = torch.randn(16, 2, 32, generator=gen)
    out_d, gx_d, g_d = _fwd_bwd(dense, x)
    out_s, gx_s, g_s = _fwd_bwd(sparse, x)
    torch.testing.assert_close(out_s, out_d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx_s, gx_d, rtol=1e-5, atol=1e-6)
    for name, m in prunable_linears(dense):
        for grads in (g_d, g_s):
            assert torch.all(grads[f"{name}.weight"][~m.weight_mask] == 0)
        torch.testing.assert_close(g_s[f"{name}.weight"], g_d[f"{name}.weight"], rtol=1e-4, atol=1e-6)
    # the masks are state: a layer built from the same spec loads them strictly
    state = sparse.state_dict()
    assert sum(k.endswith("weight_mask") for k in state) == 4
    fresh = _layer(args, threshold=0.5)
    assert [m.sparsity for _, m in prunable_linears(fresh)] == [0.0] * 4
    fresh.load_state_dict(state, strict=False)
    assert [m.uses_sparse_kernel for _, m in prunable_linears(fresh)] == [True] * 4
    torch.testing.assert_close(_fwd_bwd(fresh, x)[0], out_s, rtol=0, atol=0)


def test_structured_and_bad_schedules_are_config_errors():
    from dynmo_plugin.config import ConfigError, DynamismConfig, PruningConfig
    from dynmo_plugin.dynamism import build_scenario
    with pytest.raises(ConfigError, match="granularity.*unstructured"):
        build_scenario(DynamismConfig(kind="gradual_pruning",
                                      pruning=PruningConfig(granularity="structured")))
    with pytest.raises(ConfigError, match="s_init"):
        build_scenario(DynamismConfig(kind="gradual_pruning",
                                      pruning=PruningConfig(initial_sparsity=0.5, final_sparsity=0.4)))
