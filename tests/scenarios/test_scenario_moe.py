"""Mixture of Experts (Megatron-Core's MoELayer) under real torchrun pipeline runs.

Layers 1 and 3 are MoE (4 experts, top-2), layers 2 and 4 dense (`every` 2), on two
stages. Training is bit-deterministic (seeded data and init, one thread), so routing
counts and losses are facts of these settings; only timings vary, and the cost checks
compare ratios of layers timed in the same window.
"""
import pytest

from dynmo_plugin.config import ConfigError
from dynmo_plugin.scenarios.moe.live import (CostModel, combine_counts, cost_model_from_calibrations,
                                       ep_expert_tokens, expert_capacity, layer_work,
                                       megatron_capacity_factor, moe_layer_numbers)
from launch import losses, train, worker

MICRO_BATCHES = 2
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "2048",
         "--num-attention-heads", "4", "--seq-length", "64", "--vocab-size", "64",
         "--micro-batch-size", "4", "--global-batch-size", str(4 * MICRO_BATCHES),
         "--train-iters", "5", "--lr", "1e-2", "--seed", "7", "--pipeline-model-parallel-size", "2"]
MOE = ["--dynmo-dynamism", "moe", "--dynmo-moe-num-experts", "4", "--dynmo-moe-top-k", "2",
       "--dynmo-moe-every", "2", "--dynmo-moe-start", "1", "--dynmo-moe-interval", "1"]
HALF = ["--dynmo-moe-capacity-factor", "0.5"]  # an expert keeps at most half its fair share
# time a window after every event (no work estimates): the cost tests compare timings
STATIC = ["--dynmo", "--dynmo-balancer", "uniform", "--dynmo-profile-retime-every", "0"]


# ---- pure helpers -------------------------------------------------------------------------------
def test_moe_layer_pattern_is_megatrons_moe_layer_freq():
    assert moe_layer_numbers(8, 1) == tuple(range(1, 9))
    assert moe_layer_numbers(8, 2) == (1, 3, 5, 7)
    assert moe_layer_numbers(8, 3) == (1, 4, 7)
    assert moe_layer_numbers(4, 2, "0, 1,1,0") == (2, 3)  # the list wins over `every`
    with pytest.raises(ConfigError, match="3 entries for 4 decoder layers"):
        moe_layer_numbers(4, 1, "1,0,1")


def test_ep_straggler_is_the_busiest_expert_group():
    counts = [10, 0, 30, 20]
    assert ep_expert_tokens(counts, 1) == 60            # one rank: every token
    assert ep_expert_tokens(counts, 2) == 2 * 50        # ranks hold [10, 0] and [30, 20]
    assert ep_expert_tokens(counts, 4) == 4 * 30        # one expert per rank
    assert ep_expert_tokens([15] * 4, 4) == 60          # balanced: no straggler cost
    with pytest.raises(ValueError):
        ep_expert_tokens(counts, 3)


def test_work_is_fixed_part_plus_expert_tokens():
    model = CostModel(fixed=100.0, dense=80.0, per_token_s=1e-5)
    assert layer_work([10, 20, 30, 40], model, micro_batches=2) == 200 + 100
    assert layer_work([10, 20, 30, 40], model, 2, ep=4) == 200 + 160
    assert layer_work(None, model, 2) == 160
    assert layer_work(None, CostModel(fixed=100.0, dense=None, per_token_s=1e-5), 2) == 200


def test_counts_sum_over_replicas_and_work_follows_the_busiest():
    gathered = [
        {"tp": 0, "dp": 1, "layers": {3: [1, 1], 4: None}},
        {"tp": 0, "dp": 0, "layers": {1: [5, 3], 2: None}},
        {"tp": 1, "dp": 0, "layers": {1: [5, 3], 2: None}},   # a TP copy is not counted twice
        {"tp": 0, "dp": 0, "layers": {3: [4, 4], 4: None}},
        {"tp": 0, "dp": 1, "layers": {1: [2, 2], 2: None}},
    ]
    total, busiest = combine_counts(gathered)
    assert total == {1: [7, 5], 2: None, 3: [5, 5], 4: None}
    assert busiest == {1: [5, 3], 2: None, 3: [4, 4], 4: None}


def test_cost_model_is_the_median_over_ranks():
    runs = [{"fixed_s": 2.0, "per_token_s": 0.01, "dense_s": 1.0},
            {"fixed_s": 3.0, "per_token_s": 0.01, "dense_s": 1.5},
            {"fixed_s": 9.0, "per_token_s": 0.01, "dense_s": 9.0}, None,
            {"fixed_s": 1.0, "per_token_s": 0.0, "dense_s": 1.0}]      # unusable: no slope
    model = cost_model_from_calibrations(runs)
    assert (model.fixed, model.dense) == (300.0, 150.0)
    assert CostModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError):
        cost_model_from_calibrations([None])


def test_expert_capacity_is_rounded_and_megatron_computes_exactly_it():
    """The scenario chooses the size (a multiple of the granularity, at least one granule,
    at most every token); Megatron's get_capacity, given the factor, lands on it exactly."""
    from megatron.core.transformer.moe.moe_utils import get_capacity
    assert expert_capacity(4096, 2, 8, 0.5, 64) == 512        # the H200 row's shape
    assert expert_capacity(512, 2, 8, 0.45, 64) == 64         # 57.6 -> 64
    assert expert_capacity(512, 2, 8, 0.1, 64) == 64          # at least one granule
    assert expert_capacity(100, 8, 8, 4.0, 64) == 100         # at most every token
    assert expert_capacity(4096, 2, 8, 0.3, 128) == 256       # 307.2 -> 256
    for tokens in (64, 100, 256, 1000, 4096, 8192):
        for k, e in ((1, 4), (2, 8), (3, 7), (8, 64)):
            for c in range(1, tokens + 1, 7):
                assert get_capacity(tokens * k, e, megatron_capacity_factor(c, tokens, k, e)) == c


@pytest.mark.parametrize("top_k, capacity, every", [(1, 1.0, 2), (2, 0.0, 1), (8, 1.5, 3)])
def test_configure_model_passes_megatrons_checks(top_k, capacity, every):
    """The scenario edits a TransformerConfig that already exists; rebuilding it from its
    fields runs Megatron's __post_init__ validation (e.g. top-1 needs pre-softmax)."""
    import dataclasses

    from dynmo_plugin.config import DynamismConfig, ModelArgs
    from dynmo_plugin.scenarios.moe.live import MixtureOfExperts
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config

    settings = DynamismConfig(kind="moe")
    settings.moe.top_k, settings.moe.capacity_factor, settings.moe.every = top_k, capacity, every
    args = ModelArgs(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64,
                     micro_batch_size=4, pipeline_model_parallel_size=2)
    cfg = transformer_config(args, Layout.uniform(4, 2))
    scenario = MixtureOfExperts(settings)
    if capacity:  # the capacity needs the tokens per micro-batch, which layer_spec reads
        with pytest.raises(RuntimeError, match="layer_spec first"):
            scenario.configure_model(cfg)
    scenario.layer_spec(layer_spec("local"), args)
    scenario.configure_model(cfg)
    checked = dataclasses.replace(cfg)
    assert (checked.num_moe_experts, checked.moe_router_topk, checked.moe_layer_freq) == \
        (8, top_k, [int(n % every == 1 or every == 1) for n in range(1, 5)])
    # 256 tokens x top-k / 8 experts x capacity, rounded to 64 tokens (at least one granule)
    if capacity:
        from megatron.core.transformer.moe.moe_utils import get_capacity
        expected = expert_capacity(256, top_k, 8, capacity, 64)
        assert scenario.capacity == expected and expected % 64 == 0
        assert get_capacity(256 * top_k, 8, checked.moe_expert_capacity_factor) == expected
    else:
        assert checked.moe_expert_capacity_factor is None and scenario.capacity is None
    assert checked.moe_token_dispatcher_type == "allgather" and not checked.add_bias_linear
    settings.moe.top_k = 9
    with pytest.raises(ValueError, match="top_k"):
        MixtureOfExperts(settings)


# ---- real runs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def half(tmp_path_factory):
    """Static (Megatron's uniform split, never moved), capacity 0.5, profiled every
    iteration (every event opens a timing window when nothing moves)."""
    return train(2, MODEL + MOE + HALF + STATIC, tmp_path_factory.mktemp("half"))


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The same without a capacity: no token is dropped."""
    return train(2, MODEL + MOE + STATIC, tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="module")
def dynmo(tmp_path_factory):
    """As `half`, with the exact balancer and two forced migrations of MoE and dense layers."""
    return train(2, MODEL + MOE + HALF + ["--dynmo", "--dynmo-balancer", "exact",
                                          "--dynmo-forced-layouts", "3:Et|tttL;5:Ettt|tL"],
                 tmp_path_factory.mktemp("dynmo"))


def _events(report):
    return {e["iteration"]: e for e in report["events"] if e["kind"] == "dynamism"}


def _flop_model():
    """The scenario's FLOP cost model for the runs' shape (MODEL + MOE): a function of
    the config only, unlike the calibrated (timed) model the runs use."""
    from dynmo_plugin.config import DynamismConfig, ModelArgs
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.model import transformer_config
    from dynmo_plugin.scenarios.moe.live import MixtureOfExperts, flop_cost_model
    settings = DynamismConfig(kind="moe")
    settings.moe.num_experts, settings.moe.top_k, settings.moe.every = 4, 2, 2
    cfg = transformer_config(ModelArgs(num_layers=4, hidden_size=128, ffn_hidden_size=2048,
                                       num_attention_heads=4, pipeline_model_parallel_size=2),
                             Layout.uniform(4, 2))
    MixtureOfExperts(settings).configure_model(cfg)
    return flop_cost_model(cfg, seq_length=64, micro_batch_size=4)


def _work_ratio(report, model):
    """Per event, (MoE layers' work / dense layers' work) with the tokens each MoE layer's
    experts really processed (the run's exact counts) under `model`."""
    ratios = []
    for e in _events(report).values():
        counts = {int(n): c for n, c in e["detail"]["tokens_per_expert"].items()}
        work = {n: layer_work(counts.get(n), model, MICRO_BATCHES) for n in (1, 2, 3, 4)}
        ratios.append((work[1] + work[3]) / (work[2] + work[4]))
    return ratios


@pytest.mark.multiproc
def test_events_record_tokens_per_expert_every_iteration(half, full):
    for report, cap in ((half, 0.5), (full, 1.0)):
        events = _events(report)
        assert sorted(events) == list(range(1, 6))
        routed = MICRO_BATCHES * 4 * 64 * 2  # micro-batches x tokens x top-k
        for e in events.values():
            d = e["detail"]
            assert sorted(d["tokens_per_expert"]) == ["1", "3"]        # MoE layers only
            assert all(len(c) == 4 for c in d["tokens_per_expert"].values())
            assert all(sum(c) <= cap * routed for c in d["tokens_per_expert"].values())
            assert sorted(e["work"]) == ["1", "2", "3", "4"]          # every layer has a cost
            assert e["work"]["2"] == e["work"]["4"]                  # dense layers: constant
            # the aux loss is attached and scaled like the LM loss (1 / micro-batches)
            assert d["aux_loss_scale"] == [1.0 / MICRO_BATCHES]
            assert all(v > 0 for v in d["aux_loss"].values()) and sorted(d["aux_loss"]) == ["1", "3"]
            # the calibration ran on every rank (a failure would be noted here) and the
            # expert capacity is the rounded one: 256 tokens x 2 / 4 experts x 0.5 = 64
            assert "fallbacks" not in d, d.get("fallbacks")
            assert d["cost_model"]["source"] == "calibrated"
            assert d["expert_capacity"] == (64 if cap == 0.5 else None)
            # EP straggler model: never below the one-rank work
            assert all(d["ep_straggler"]["work"][n] >= e["work"][n] for n in ("1", "3"))
    assert all(d == 1.0 for e in _events(full).values() for d in e["detail"]["kept"].values())
    assert all(d <= 0.5 for e in _events(half).values() for d in e["detail"]["kept"].values())


@pytest.mark.multiproc
def test_moe_layer_work_tracks_tokens_processed(half, full):
    """Half the tokens dropped -> the MoE layers' experts process at most about half the
    tokens, every iteration (exact counts), and by the FLOP cost model the MoE layers'
    work relative to the dense ones falls by more than 15%, every iteration. (The runs'
    profiles measured the same direction; timing claims are not asserted here.)"""
    for h, f in zip(_events(half).values(), _events(full).values()):
        tokens = [sum(sum(c) for c in e["detail"]["tokens_per_expert"].values()) for e in (h, f)]
        assert tokens[0] <= 0.55 * tokens[1], tokens
    model = _flop_model()
    for h, f in zip(_work_ratio(half, model), _work_ratio(full, model)):
        assert h < 0.85 * f, (h, f)


@pytest.mark.multiproc
def test_dynmo_losses_equal_static_with_moe(half, dynmo):
    assert losses(dynmo) == losses(half)
    # routing is a function of the weights only: the same counts whatever the layout
    assert ([e["detail"]["tokens_per_expert"] for e in _events(dynmo).values()]
            == [e["detail"]["tokens_per_expert"] for e in _events(half).values()])
    applied = [e for e in dynmo["events"] if e["kind"] == "rebalance" and e["applied"]]
    assert {e["iteration"] for e in applied if e["trigger"] == "forced"} >= {3, 5}, applied
    sources = [e["profile_source"] for e in dynmo["events"] if e["kind"] == "rebalance"
               and e["trigger"].startswith("event:")]
    assert "timed" in sources and "estimated" in sources, sources  # work estimates in between
    assert not [e for e in half["events"] if e["kind"] == "rebalance" and e["applied"]]


@pytest.mark.multiproc
def test_aux_loss_gradient_reaches_training(half, tmp_path):
    """The load-balancing loss changes no forward value but joins backward: with its
    coefficient at 0 the first loss is the same and the second differs."""
    flags = MODEL + MOE + HALF + ["--dynmo-moe-aux-loss-coeff", "0", "--train-iters", "2"]
    plain = train(2, flags, tmp_path / "no_aux")
    assert losses(plain)[0] == losses(half)[0]
    assert losses(plain)[1] != losses(half)[1]


def test_flop_fixed_tokens_is_the_calibration_fallback_split():
    """When timing cannot tell full from quarter capacity, calibrate splits the layer's
    time by matmul FLOPs: (8h^2 + 4sh + 2hE) / 4hf expert tokens per token (6hf gated)."""
    from types import SimpleNamespace

    from dynmo_plugin.scenarios.moe.layer import flop_fixed_tokens
    cfg = SimpleNamespace(hidden_size=32, moe_ffn_hidden_size=128, ffn_hidden_size=64,
                          num_moe_experts=4, gated_linear_unit=False)
    assert flop_fixed_tokens(cfg, 16) == (8 * 32 * 32 + 4 * 16 * 32 + 2 * 32 * 4) / (4 * 32 * 128)
    gated = SimpleNamespace(**{**vars(cfg), "gated_linear_unit": True, "moe_ffn_hidden_size": None})
    assert flop_fixed_tokens(gated, 16) == (8192 + 2048 + 256) / (6 * 32 * 64)


@pytest.mark.multiproc
def test_one_ranks_failed_calibration_is_noted_not_quiet(tmp_path):
    """Stage 0's calibration raises (injected), stage 1's succeeds: the cost model comes
    from stage 1, and the first event says that rank 0 failed (before, only a log line
    did, and a broken calibration could pass every test)."""
    flags = MODEL + MOE + HALF + ["--train-iters", "2", "--dynmo", "--test-fault",
                                  "calibration_exception@0"]
    report = worker(2, flags, tmp_path, timeout=240)
    events = _events(report)
    noted = [e["detail"]["fallbacks"] for e in events.values() if "fallbacks" in e["detail"]]
    assert len(noted) == 1, events
    (fallback,) = noted[0]
    assert fallback["phase"] == "moe-calibration" and fallback["reason"].startswith("rank 0: ")
    assert "InjectedFault" in fallback["reason"]
    assert all(e["detail"]["cost_model"]["source"] == "calibrated" for e in events.values())


@pytest.mark.multiproc
def test_resumed_padded_moe_trains_on_exactly(half, tmp_path):
    """A checkpoint of the padded MoE layers (capacity 0.5: batched experts, whose
    per-expert weights lie side by side in one buffer) saved at iteration 3 and resumed:
    iterations 4-5 have the uninterrupted run's losses to the last bit (the checkpoint
    holds each expert's weights under Megatron's keys; loading copies into the packed
    buffer and keeps it packed)."""
    ckpt = tmp_path / "ckpt"
    saved = train(2, MODEL + MOE + HALF + STATIC + ["--save", str(ckpt), "--save-interval", "3",
                                                     "--train-iters", "3"], tmp_path / "first")
    assert losses(saved) == losses(half)[:3]
    resumed = train(2, MODEL + MOE + HALF + STATIC + ["--load", str(ckpt)], tmp_path / "resumed")
    assert [it["iteration"] for it in resumed["iterations"]] == [4, 5]
    assert losses(resumed) == losses(half)[3:]
