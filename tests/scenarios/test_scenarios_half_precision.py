"""Every dynamism scenario trains in bf16 and fp16, and a failed calibration is an event.

Real torchrun runs (2 pipeline stages, gloo) of tiny models (4 layers, hidden 32,
32 tokens, 4 iterations) with each scenario's events early, so its calibration and its
first decisions run in half precision: what a dtype error in a scratch layer (the MoD,
MoE and sparse-attention work models time one) or in a scenario's layer kills. Then a
named fault (`calibration_exception`, dynmo_plugin.faults) fails a calibration: the
run must finish, with an event that says why and that the FLOP-based model took over.
"""
import json
import math

import pytest

from dynmo_plugin.scenarios.flops import FLOP_FALLBACK, DecoderFlops
from dynmo_plugin.scenarios.mixture_of_depths.live import WorkModel
from dynmo_plugin.scenarios.moe.live import CostModel, cost_model_from_calibrations, layer_work
from dynmo_plugin.scenarios.sparse_attention.live import AttentionCostModel
from launch import losses, worker

ITERS = 4
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "64", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-2", "--seed", "7",
         "--pipeline-model-parallel-size", "2", "--dynmo"]
SCENARIOS = {
    "gradual_pruning": ["--dynmo-pruning-start", "1", "--dynmo-pruning-interval", "2",
                        "--dynmo-pruning-rounds", "2", "--dynmo-pruning-initial-sparsity", "0.5",
                        "--dynmo-pruning-final-sparsity", "0.9"],
    "layer_freezing": ["--dynmo-freezing-start", "1", "--dynmo-freezing-interval", "1",
                       "--dynmo-freezing-threshold", "100", "--dynmo-freezing-max-layers", "2"],
    "mixture_of_depths": ["--dynmo-mod-every", "1", "--dynmo-mod-capacity", "1.0",
                          "--dynmo-mod-final-capacity", "0.5", "--dynmo-mod-start", "2",
                          "--dynmo-mod-interval", "1", "--dynmo-mod-rounds", "2"],
    "moe": ["--ffn-hidden-size", "64", "--dynmo-moe-num-experts", "4", "--dynmo-moe-top-k", "2",
            "--dynmo-moe-every", "2", "--dynmo-moe-capacity-factor", "1.0",
            "--dynmo-moe-start", "2", "--dynmo-moe-interval", "2"],
    "early_exit": ["--dynmo-early-exit-threshold", "0.02", "--dynmo-early-exit-start", "2",
                   "--dynmo-early-exit-interval", "2", "--dynmo-early-exit-min-layer", "1",
                   "--dynmo-early-exit-loss-weight", "0.5"],
    "sparse_attention": ["--dynmo-sparse-attention-buckets", "1",
                         "--dynmo-sparse-attention-buckets-per-layer", "1:1",
                         "--dynmo-sparse-attention-final-buckets", "4",
                         "--dynmo-sparse-attention-rounds", "1", "--dynmo-sparse-attention-start", "2",
                         "--dynmo-sparse-attention-interval", "1"],
}
# fp16 adds the loss scaler: the scenarios whose own losses scale by it (MoD's predictor,
# early exit's heads) and those that time a scratch layer in the run's dtype
FP16 = ["mixture_of_depths", "moe", "early_exit", "sparse_attention"]
CASES = [(s, "bf16") for s in SCENARIOS] + [(s, "fp16") for s in FP16]
# where each calibrating scenario's event detail keeps its fitted work model
MODEL_KEY = {"mixture_of_depths": "work_model", "moe": "cost_model", "sparse_attention": "cost_model"}


def _flags(scenario: str, precision: str) -> list[str]:
    half = ["--bf16"] if precision == "bf16" else ["--fp16", "--initial-loss-scale", "1024"]
    return MODEL + half + ["--dynmo-dynamism", scenario] + SCENARIOS[scenario]


def _scenario_events(report: dict, scenario: str) -> list[dict]:
    return [e for e in report["events"] if e.get("kind") == "dynamism" and e["scenario"] == scenario]


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario,precision", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_scenario_trains_in_half_precision(tmp_path, scenario, precision):
    report = worker(2, _flags(scenario, precision) + ["--test-dump-dtypes"], tmp_path, timeout=240)
    # what trained, read from the model and the optimizer on every rank, not the echoed flag:
    # half-precision parameters, fp32 main parameters and optimizer state
    half = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    ranks = [json.loads((tmp_path / f"dtypes_rank{r}.json").read_text()) for r in range(2)]
    assert all(d["params"] == [half] for d in ranks), ranks
    # a stage whose layers all froze has nothing left to optimise; every other keeps fp32
    assert all(d["main_params"] == d["optimizer_state"] == ["float32"] for d in ranks
               if d["main_params"]) and any(d["main_params"] for d in ranks), ranks
    assert len(losses(report)) == ITERS and all(math.isfinite(x) for x in losses(report))
    events = _scenario_events(report, scenario)
    assert events, f"{scenario}: no event in {ITERS} iterations"
    # the real calibration and decisions ran in this precision: no fallback was needed
    assert [e["detail"]["fallbacks"] for e in events if "fallbacks" in e["detail"]] == []
    if scenario in MODEL_KEY:
        model = next(e["detail"][MODEL_KEY[scenario]] for e in events if MODEL_KEY[scenario] in e["detail"])
        assert model.get("source") != "flops"


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario", ["mixture_of_depths", "sparse_attention"])
def test_failed_calibration_is_an_event_with_the_flop_fallback(tmp_path, scenario):
    """MoD calibrates at its first event (rank 0), sparse attention when it attaches
    (pipeline rank 0): the injected failure on stage 0 must not end training."""
    report = worker(2, _flags(scenario, "bf16") + ["--test-fault", "calibration_exception@0"],
                    tmp_path, timeout=240)
    assert len(losses(report)) == ITERS
    events = _scenario_events(report, scenario)
    noted = [e for e in events if "fallbacks" in e["detail"]]
    assert len(noted) == 1, events
    (fallback,) = noted[0]["detail"]["fallbacks"]
    assert fallback["phase"].endswith("calibration") and fallback["fallback"] == FLOP_FALLBACK
    assert "InjectedFault: injected failure in" in fallback["reason"]
    # the events after it predict work from the FLOP model
    model = next(e["detail"][MODEL_KEY[scenario]] for e in events if MODEL_KEY[scenario] in e["detail"])
    assert model["source"] == "flops"
    assert all(e["work"] for e in events if e["detail"].get("round") or e["detail"].get("change"))


# ---- the FLOP fallbacks themselves (pure) ---------------------------------------------------
def test_flop_work_models_order_layers_as_their_work():
    f = DecoderFlops(hidden=64, ffn_hidden=256)
    mod = WorkModel.from_flops(f, predictor_width=8, seq_length=128, micro_batch_size=2)
    assert mod.source == "flops" and mod.units(None) == 256
    assert mod.units(0.125) < mod.units(0.5) < mod.units(1.0)
    assert mod.units(1.0) == pytest.approx(256, rel=0.05)  # the router and predictor on top

    attn = AttentionCostModel.from_flops(f, seq_length=1024, micro_batch_size=1, hashes=1)
    assert attn.layer_ms(64) < attn.layer_ms(8) < attn.layer_ms(1)
    # dense attention over s keys per query, LSH over ceil(s/B): the same FLOPs per pair
    assert attn.attention_ms(4) == pytest.approx(attn.attention_ms(1) / 4)


def test_moe_calibration_errors_reach_the_reason():
    with pytest.raises(ValueError, match=r"rank 0: RuntimeError: dtype.*rank 1: RuntimeError: oom"):
        cost_model_from_calibrations([{"error": "RuntimeError: dtype"}, {"error": "RuntimeError: oom"}])
    good = {"fixed_s": 2.0, "per_token_s": 0.01, "dense_s": 3.0}
    model = cost_model_from_calibrations([{"error": "RuntimeError: dtype"}, good])
    assert (model.fixed, model.dense) == (200.0, 300.0)
    assert layer_work([10, 20], CostModel(fixed=5.0, dense=7.0, per_token_s=1.0, source="flops"), 2) == 40.0
