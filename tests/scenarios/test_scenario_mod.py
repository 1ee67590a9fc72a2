"""Mixture of Depths: the routed layer in one Megatron process, the scenario in real
torchrun pipeline runs (2 stages, gloo), and its pure parts.

The two runs (module-scoped, ~20 s each on a quiet machine) train 6 routed layers (every 1) of hidden 128
over 256-token sequences: layers 1 and 2 keep capacities 0.25 and 0.75
(`capacity_per_layer`), layers 3-6 follow the schedule 1.0 -> 0.5625 (iteration 4)
-> 0.125 (iteration 8). Stage 0 (layers 1-3) thus holds blocks at 0.25, 0.75 and
1.0 -> 0.125 side by side: per-layer cost ratios are read within one window on one
rank, where machine load cancels out. The static run (`uniform` balancer) never moves;
the DynMo run (`exact`) rebalances after the capacity event at 8 (layer 3, whose
capacity buffer has changed, moves to stage 1) and is forced back at 10.
"""
import pytest
import torch

from dynmo_plugin.config import ConfigError
from dynmo_plugin.scenarios.mixture_of_depths.config import ModConfig
from dynmo_plugin.scenarios.mixture_of_depths.live import (CapacitySchedule, WorkModel,
                                                     parse_capacities, predictor_summary,
                                                     routed_layers)
from launch import in_megatron_process, losses, train

MODEL = ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "256", "--vocab-size", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "10", "--seed", "7",
         "--pipeline-model-parallel-size", "2"]
SCENARIO = ["--dynmo-dynamism", "mixture_of_depths", "--dynmo-mod-every", "1",
            "--dynmo-mod-capacity", "1.0", "--dynmo-mod-capacity-per-layer", "1:0.25,2:0.75",
            "--dynmo-mod-final-capacity", "0.125", "--dynmo-mod-start", "4",
            "--dynmo-mod-interval", "4", "--dynmo-mod-rounds", "2",
            "--dynmo-mod-granularity", "32",  # 256-token sequences: 0.125 is one granule
            "--dynmo", "--dynmo-profile-every", "3"]


# ---- pure parts ---------------------------------------------------------------------------
def test_routed_layers_and_overrides():
    assert routed_layers(8, 2) == [2, 4, 6, 8]
    assert routed_layers(3, 1) == [1, 2, 3]
    assert parse_capacities(" 2:0.25, 4:0.75 ", [2, 4]) == {2: 0.25, 4: 0.75}
    assert parse_capacities("", [2]) == {}
    for bad, why in [("3:0.5", "not routed"), ("2:0", r"\(0, 1\]"), ("2:1.5", r"\(0, 1\]"),
                     ("2=0.5", "layer:capacity"), ("2:0.5,2:0.25", "twice")]:
        with pytest.raises(ConfigError, match=why):
            parse_capacities(bad, [2, 4])


def test_capacity_schedule():
    mod = ModConfig(every=2, capacity=1.0, capacity_per_layer="4:0.5", final_capacity=0.25,
                    start=10, interval=5, rounds=3)
    sched = CapacitySchedule.from_config(mod, 6)
    assert [sched.event_index(i) for i in (9, 10, 12, 15, 20, 25)] == [None, 1, None, 2, 3, None]
    assert sched.capacities(0) == {2: 1.0, 4: 0.5, 6: 1.0}
    assert sched.capacities(1) == {2: 0.75, 4: 0.5, 6: 0.75}   # the override stays
    assert sched.capacities(3) == {2: 0.25, 4: 0.5, 6: 0.25}
    constant = CapacitySchedule.from_config(ModConfig(every=2, capacity=0.125), 4)
    assert constant.constant and constant.capacities(5) == {2: 0.125, 4: 0.125}
    with pytest.raises(ConfigError, match="routes no layer"):
        CapacitySchedule.from_config(ModConfig(every=5), 4)


def test_work_model_fit_and_units():
    truth = WorkModel(0.002, 0.010, 0.020, 0.031, seq_length=256, micro_batch_size=2)
    samples = [(c, truth.seconds(c)) for c in (1.0, 0.75, 0.5, 0.25, 0.125)]
    fitted = WorkModel.fit(samples, 0.031, 256, 2)
    assert fitted.fixed_s == pytest.approx(0.002) and fitted.linear_s == pytest.approx(0.010)
    assert fitted.quadratic_s == pytest.approx(0.020)
    assert fitted.units(None) == 512                 # a plain layer: s x b tokens
    assert fitted.units(1.0) == pytest.approx(512 * 0.032 / 0.031)  # + router/predictor
    assert fitted.units(0.25) < fitted.units(0.75) < fitted.units(None)
    assert fitted.work(3, {2: 0.5}) == {1: 512.0, 2: round(fitted.units(0.5), 3), 3: 512.0}
    # noise that makes a coefficient negative drops it instead
    noisy = WorkModel.fit([(1.0, 0.03), (0.5, 0.016), (0.25, 0.0081)], 0.029, 256, 2)
    assert min(noisy.fixed_s, noisy.linear_s, noisy.quadratic_s) >= 0
    assert noisy.seconds(1.0) == pytest.approx(0.03, rel=0.05)


def test_predictor_summary_sums_replicas():
    # [tokens, selected, predicted, predicted & selected, right]
    out = predictor_summary([{2: [100, 25, 20, 15, 80]}, {2: [100, 25, 30, 20, 70]}, {}])
    assert out == {2: {"accuracy": 0.75, "recall": 0.7, "precision": 0.7, "baseline": 0.75}}


# ---- the layer, in one Megatron process ------------------------------------------------------
def _check_routing(args):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config

    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = mod_spec(layer_spec(), {2: 0.5}, 8, granularity=8)
    plain, routed = (build_module(spec, config=cfg, layer_number=n) for n in (1, 2))
    assert not plain.routed and not hasattr(plain, "router")
    assert routed.routed and "capacity" in routed.state_dict()   # a buffer: migrations move it
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in routed.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    routed.mod_context = ModContext(predictor_loss_weight=1.0, grad_scale=1.0, collect_stats=True)
    s, b, h = args.seq_length, 3, args.hidden_size
    x = torch.randn(s, b, h, generator=gen, requires_grad=True)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    rope = RotaryEmbedding(kv_channels=h // args.num_attention_heads, rotary_percent=1.0)(s)
    out, _ = routed(hidden_states=x, attention_mask=causal, rotary_pos_emb=rope)

    # reference: the plain layer over ALL tokens, unselected keys masked, at true positions
    with torch.no_grad():
        logits = routed.router(x).squeeze(-1)
        idx = torch.topk(logits, s // 2, dim=0).indices
        sel = torch.zeros(s, b, dtype=torch.bool).scatter(0, idx, True)
        mask = causal | ~sel.T[:, None, None, :]
        full, _ = TransformerLayer.forward(routed, hidden_states=x, attention_mask=mask,
                                           rotary_pos_emb=rope)
        gate = torch.sigmoid(logits)[..., None]
        ref = torch.where(sel[..., None], x + gate * (full - x), x)
    assert (out - ref).abs().max() < 1e-5, (out - ref).abs().max()
    assert torch.equal(out[~sel], x[~sel])        # skipped tokens ride the residual
    tokens, selected, predicted, both, right = routed.mod_counts()
    assert [tokens, selected] == [s * b, s // 2 * b]
    with torch.no_grad():
        yes = routed.predictor(x).float() > 0
    assert [predicted, both] == [int(yes.sum()), int((yes & sel).sum())]
    assert right == int((yes == sel).sum())

    out.sum().backward()
    assert routed.router.weight.grad.abs().sum() > 0          # through the gate
    assert routed.predictor.fc1.weight.grad.abs().sum() > 0   # its BCE loss
    # the predictor's input is detached: without its loss, the input gradient is the same
    grad_with = x.grad.clone()
    x.grad = None
    routed.mod_context = ModContext(predictor_loss_weight=0.0, grad_scale=1.0)
    out2, _ = routed(hidden_states=x, attention_mask=causal, rotary_pos_emb=rope)
    out2.sum().backward()
    assert torch.equal(x.grad, grad_with)

    routed.set_capacity(1.0)  # every token: the gated plain layer
    out3, _ = routed(hidden_states=x, attention_mask=causal, rotary_pos_emb=rope)
    with torch.no_grad():
        y, _ = TransformerLayer.forward(routed, hidden_states=x, attention_mask=causal,
                                        rotary_pos_emb=rope)
    assert (out3 - (x + gate * (y - x))).abs().max() < 1e-5


@pytest.mark.multiproc
def test_routed_layer_equals_masked_full_layer_at_original_positions():
    in_megatron_process(_check_routing)


# ---- work counted, not timed: the runs' layer shape (hidden 128, 256 tokens, micro-batch 2) --
# The timing side (profiled cost ratios by capacity) lives in scripts/bench_mod.py.
CAPACITIES = (1.0, 0.75, 0.5, 0.25, 0.125)


def _count_layer_flops(args) -> dict:
    """{capacity (None: a plain layer): FLOPs of one forward + backward}, counted by torch's
    FlopCounterMode from the matmuls the real MoDLayer dispatches (router, predictor,
    projections and MLP over the selected tokens, attention among them)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module
    from torch.utils.flop_counter import FlopCounterMode

    from dynmo_plugin.megatron.training.model import layer_spec
    from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
    cfg = transformer_config_of(args)
    spec = mod_spec(layer_spec(), {2: 1.0}, 16, granularity=32)  # every capacity x 256 exact
    plain, routed = (build_module(spec, config=cfg, layer_number=n) for n in (1, 2))
    routed.mod_context = ModContext(predictor_loss_weight=1.0, grad_scale=1.0)
    s, h = args.seq_length, args.hidden_size
    x = torch.randn(s, 2, h, generator=torch.Generator().manual_seed(0), requires_grad=True)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    rope = RotaryEmbedding(kv_channels=h // args.num_attention_heads, rotary_percent=1.0)(s)
    flops = {}
    for capacity in (None,) + CAPACITIES:
        layer = plain if capacity is None else routed
        if capacity is not None:
            layer.set_capacity(capacity)
        with FlopCounterMode(display=False) as counter:
            layer(hidden_states=x, attention_mask=causal, rotary_pos_emb=rope)[0].sum().backward()
        flops[capacity] = counter.get_total_flops()
    return flops


def _check_block_work(args):
    from dynmo_plugin.scenarios.flops import DecoderFlops
    from dynmo_plugin.scenarios.mixture_of_depths.live import WorkModel
    f = _count_layer_flops(args)
    # the run's stage 0 side by side: 0.25 vs 0.75, 1.0 vs 0.75 (before), 0.125 vs 0.75
    assert f[0.25] < 0.7 * f[0.75] and f[1.0] > 1.1 * f[0.75] and f[0.125] < 0.6 * f[0.75], f
    # the work model's form (fixed + linear c + quadratic c^2), fitted to three counts,
    # is the layer's work at the others: what the run's timed fit scales
    fitted = WorkModel.fit([(c, f[c]) for c in (1.0, 0.5, 0.125)], f[None], args.seq_length, 2)
    for c in (0.75, 0.25):
        assert fitted.seconds(c) == pytest.approx(f[c], rel=1e-6), (c, f)
    # the FLOP fallback model gives each capacity's share of a plain layer as counted
    model = WorkModel.from_flops(DecoderFlops.from_config(transformer_config_of(args)), 16,
                                 args.seq_length, 2)
    for c in CAPACITIES:
        assert model.units(c) / model.units(None) == pytest.approx(f[c] / f[None], rel=0.1), (c, f)


def transformer_config_of(args):
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import transformer_config
    return transformer_config(args, Layout.uniform(args.num_layers, 1))


@pytest.mark.multiproc
def test_block_work_tracks_capacity_and_the_work_model():
    """A routed block's counted work falls with its capacity as the runs' profiles showed
    (stage 0: 0.25 / 0.75 measured ~0.45x, 1.0 / 0.75 ~1.4x, 0.125 / 0.75 ~0.35x), and the
    work model the scenario reports has the form of that work."""
    from dynmo_plugin.config import ModelArgs
    in_megatron_process(_check_block_work, ModelArgs(num_layers=2, hidden_size=128,
                                                      num_attention_heads=4, seq_length=256))


# ---- real runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def static(tmp_path_factory):
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "uniform"],
                 tmp_path_factory.mktemp("static"))


@pytest.fixture(scope="module")
def dynmo(tmp_path_factory):
    # --dynmo-min-gain 0: the move after the event must not hang on the gate's noise floor,
    # which follows the measured dispersion of this loaded machine (one CI run read a 12.6%
    # gain under a 14.3% floor); the floor has its own tests (test_gate_dispersion).
    return train(2, MODEL + SCENARIO + ["--dynmo-balancer", "exact", "--dynmo-min-gain", "0",
                                        "--dynmo-forced-layouts", "10:Ettt|tttL"],
                 tmp_path_factory.mktemp("dynmo"))


def _events(report):
    return [e for e in report["events"] if e["kind"] == "dynamism"]


def _timed(report):
    """(first iteration of the window, {layer: profile entry}) of every timed window."""
    return [(e["window"][0], {x["layer"]: x for x in e["profile"]["layers"]})
            for e in report["events"]
            if e.get("profile") and e["profile"].get("layers") and e.get("window")
            and e.get("profile_source", "timed") == "timed"]


@pytest.mark.multiproc
def test_events_follow_the_capacity_schedule(static):
    events = _events(static)
    assert [e["iteration"] for e in events] == [4, 8]
    first, last = (e["detail"] for e in events)
    assert first["capacity"] == {"1": 0.25, "2": 0.75, "3": 0.5625, "4": 0.5625, "5": 0.5625,
                                 "6": 0.5625}
    assert last["capacity_before"] == first["capacity"]
    assert last["capacity"]["3"] == 0.125 and last["tokens_per_sample"]["3"] == 32
    # 0.5625 x 256 = 144 tokens, rounded to the granularity (32): 160, and so reported
    assert first["tokens_per_sample"]["3"] == 160 and first["capacity_used"]["3"] == 0.625
    assert first["granularity"] == 32
    assert first["tokens_per_sample"]["1"] == 64 and first["tokens_per_sample"]["2"] == 192
    for e in events:
        assert sorted(int(k) for k in e["work"]) == list(range(1, 7))
        for layer, p in e["detail"]["predictor"].items():
            assert 0 <= p["accuracy"] <= 1 and 0 <= p["recall"] <= 1
    # before event 4 every scheduled layer ran all 256 tokens (the target: all selected)
    assert first["predictor"]["3"]["baseline"] == 0.0
    assert first["predictor"]["1"]["baseline"] == 0.75
    work = {int(k): v for k, v in events[-1]["work"].items()}
    assert work[3] < work[1] < work[2]          # 0.125 < 0.25 < 0.75
    triggers = [e["trigger"] for e in static["events"] if e["kind"] == "rebalance"]
    assert triggers == ["event:mixture_of_depths@4", "event:mixture_of_depths@8"]


@pytest.mark.multiproc
def test_shadow_layers_keep_parameter_and_optimizer_memory(static):
    """A block at capacity 0.25 holds the same parameters, gradients and Adam state as
    one at 0.75 (all layers are routed here, so all have the same shapes); only the
    activations it saves shrink."""
    for _, w in _timed(static):
        for key in ("param_bytes", "grad_bytes", "optim_bytes"):
            assert len({x[key] for x in w.values()}) == 1, key
        assert w[1]["optim_bytes"] >= w[1]["param_bytes"] > 0
        assert w[1]["act_bytes"] < 0.6 * w[2]["act_bytes"]


@pytest.mark.multiproc
def test_dynmo_losses_equal_static_with_mixture_of_depths(static, dynmo):
    assert losses(dynmo) == losses(static)
    applied = [e for e in dynmo["events"] if e["kind"] == "rebalance" and e["applied"]]
    event_moves = [e for e in applied if e["trigger"].startswith("event:mixture_of_depths@")]
    assert event_moves, [(e["trigger"], e.get("reason")) for e in dynmo["events"]
                         if e["kind"] == "rebalance"]
    assert any(e["trigger"] == "forced" for e in applied)
    assert not [e for e in static["events"] if e["kind"] == "rebalance" and e["applied"]]


@pytest.mark.multiproc
def test_predictor_learns_top_c_membership(tmp_path):
    """One process, capacity 0.5 (so 'always skip' scores 0.5): after 20 iterations the
    causal predictor of layer 2 is right about ~0.89 of the tokens (deterministic run)."""
    small = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--vocab-size", "64", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-3",
             "--dynmo-dynamism", "mixture_of_depths", "--dynmo-mod-every", "2",
             "--dynmo-mod-capacity", "0.5", "--dynmo-mod-start", "20", "--dynmo-mod-rounds", "1",
             "--dynmo-mod-granularity", "32"]
    (event,) = _events(train(1, small, tmp_path))
    p = event["detail"]["predictor"]["2"]
    assert p["baseline"] == 0.5 and p["accuracy"] > 0.75 and p["recall"] > 0.75, p
    assert "1" not in event["detail"]["predictor"]      # layer 1 is not routed
    assert event["work"]["1"] == 256                    # a plain layer: its s x b tokens
