"""Structured pruning that physically shrinks (issue 24): real torchrun runs, gloo.

Three PP=2 runs of configs/gradual_pruning.yaml with 80% of FFN neurons pruned (events
at iterations 8, 11, 14): masked (`--dynmo-pruning-structured masked`, the old form:
full-size weights, kept neurons gathered per call) and physical (the default) under
the `exact` balancer, which migrates pruned layers, and physical under `uniform`,
which never moves them. Measured on this CPU: the physical run's losses equal the
masked run's to the last bit (tolerance 0: the same GEMMs on the same values), and
the migrated run equals the never-moved one to the last bit.

Then a checkpoint: a small physical run saves after its first shrink; runs resumed from
it under another PP=2 layout (to the bit) and under PP=1 (losses to 1e-5, see the test)
continue the uninterrupted run (losses and final checkpoint, key by key). The
checkpoint stores full width, zeros at pruned neurons: the form a masked run stores.
"""
import shutil

import pytest
import torch

from launch import ROOT, in_megatron_process, losses, worker
from test_scenario_pruning import _fwd_bwd, seeded_layer  # one layer: shared helpers

FLAGS = ["--dynmo", "--dynmo-config", str(ROOT / "configs" / "gradual_pruning.yaml"),
         "--vocab-size", "8192", "--micro-batch-size", "2", "--global-batch-size", "8",  # as test_scenario_pruning.py
         "--dynmo-profile-every", "4", "--test-dump-params", "--dynmo-min-gain", "0",
         "--dynmo-pruning-granularity", "structured", "--dynmo-pruning-final-sparsity", "0.8"]
HIDDEN, FFN, LAYERS = 256, 1024, 8
FC = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight")


@pytest.fixture(scope="module")
def runs(shared_run):
    """{(mode, balancer): (report, parameters)}; the masked run is test_scenario_pruning's
    structured DynMo run (the same flags: launched once per session)."""
    out = {}
    for mode, balancer in (("masked", "exact"), ("physical", "exact"), ("physical", "uniform")):
        d, report = shared_run(2, FLAGS + ["--dynmo-balancer", balancer, "--dynmo-pruning-structured", mode])
        out[mode, balancer] = report, _params(d)
    return out


def _params(d) -> dict:
    params = {}
    for rank in (0, 1):
        params.update(torch.load(d / f"params_rank{rank}.pt"))
    return params


def _last_profile(report) -> dict:
    return [e["profile"] for e in report["events"]
            if e["kind"] in ("profile", "rebalance") and e.get("profile")][-1]


def _sparsity(report) -> dict:
    return [e for e in report["events"] if e["kind"] == "dynamism"][-1]["detail"]["sparsity"]


def _layer_params(kept: int) -> int:
    """Parameters of one local-spec GPT layer with `kept` FFN neurons (biases on)."""
    h = HIDDEN
    attention = 3 * h * h + 3 * h + h * h + h
    norms = 4 * h
    return attention + norms + kept * h + kept + h * kept + h


@pytest.mark.multiproc
def test_physical_run_equals_masked_run_and_its_layers_shrink(runs):
    (masked, mp), (physical, pp) = runs["masked", "exact"], runs["physical", "exact"]
    assert losses(physical) == losses(masked)  # measured: bit-exact (tolerance 0)
    sparsity = _sparsity(physical)
    assert sparsity == _sparsity(masked)
    rounds = [e["detail"] for e in physical["events"] if e["kind"] == "dynamism"]
    assert all(d["width_multiple"] == 128 for d in rounds)
    # every width a round reported is a multiple of 128 (GEMM-friendly), the widths shrink
    assert all(w % 128 == 0 for d in rounds for w in d["ffn_width"].values()), rounds
    widths = rounds[-1]["ffn_width"]
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        full1, full2 = mp[prefix + FC[0]], mp[prefix + FC[2]]
        kept = ~(full1 == 0).all(dim=1)
        assert int(kept.sum()) == round((1 - sparsity[str(layer + 1)]) * FFN)
        assert pp[prefix + FC[0]].shape == (int(kept.sum()), HIDDEN)  # really smaller
        assert widths[str(layer + 1)] == int(kept.sum()) < FFN  # the width the event reported
        assert torch.equal(pp[prefix + FC[0]], full1[kept])
        assert torch.equal(pp[prefix + FC[1]], mp[prefix + FC[1]][kept])
        assert torch.equal(pp[prefix + FC[2]], full2[:, kept])
        others = [k for k in mp if k.startswith(prefix) and not k.endswith(FC)]
        assert [k for k in others if not torch.equal(mp[k], pp[k])] == []


@pytest.mark.multiproc
def test_profile_memory_model_carries_the_smaller_layers(runs):
    """What the balancer's memory model reads: each layer's parameter, gradient (DDP
    buffer view) and Adam bytes at its pruned width; the stages' static bytes (whole DDP
    buffers and optimizer state) fall by 16 B per pruned parameter in fp32."""
    (masked, _), (physical, _) = runs["masked", "exact"], runs["physical", "exact"]
    sparsity = _sparsity(physical)
    for layer in _last_profile(physical)["layers"]:
        kept = round((1 - sparsity[str(layer["layer"])]) * FFN)
        assert layer["param_bytes"] == 4 * _layer_params(kept)
        assert layer["grad_bytes"] == layer["param_bytes"]
        # exp_avg, exp_avg_sq and a 4-byte `step` for each of the layer's 12 parameters
        assert layer["optim_bytes"] == 2 * layer["param_bytes"] + 4 * 12
    for layer in _last_profile(masked)["layers"]:
        assert layer["param_bytes"] == 4 * _layer_params(FFN)
    pruned = sum(_layer_params(FFN) - _layer_params(round((1 - s) * FFN)) for s in sparsity.values())
    static = {name: sum(s["static_bytes"] for s in _last_profile(r)["stages"])
              for name, r in (("masked", masked), ("physical", physical))}
    assert static["masked"] - static["physical"] == 16 * pruned


@pytest.mark.multiproc
def test_migrated_pruned_layers_equal_never_moved(runs):
    (moved, mp), (still, sp) = runs["physical", "exact"], runs["physical", "uniform"]
    assert any(e.get("applied") for e in moved["events"] if e["kind"] == "rebalance")
    assert not any(e.get("applied") for e in still["events"] if e["kind"] == "rebalance")
    assert losses(moved) == losses(still)
    assert mp.keys() == sp.keys()
    assert [k for k in mp if not torch.equal(mp[k], sp[k])] == []


# ---- checkpoint saved after a physical shrink, resumed under other pipeline sizes -------
SMALL = ["--dynmo", "--dynmo-config", str(ROOT / "configs" / "gradual_pruning.yaml"),
         "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--vocab-size", "256", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "9", "--seed", "5",
         "--dynmo-pruning-granularity", "structured", "--dynmo-pruning-final-sparsity", "0.7",
         "--dynmo-pruning-start", "2", "--dynmo-pruning-interval", "3", "--dynmo-pruning-rounds", "2",
         "--dynmo-balancer", "uniform", "--save-interval", "3",
         "--dynmo-pruning-width-multiple", "8"]  # rounds at 5 and 8; FFN 128 wide: widths of 8


def _final(root) -> dict:
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import read_tensors
    return read_tensors(str(root / "iter_0000009"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned_saved")
    report = worker(2, SMALL + ["--pipeline-model-parallel-size", "2", "--save", str(out / "ckpt")], out)
    return out, report


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc,flags", [
    (1, ["--pipeline-model-parallel-size", "1"]),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttL"])],
    ids=["pp1", "pp2-other-layout"])
def test_checkpoint_after_shrink_resumes_under_another_layout(saved, tmp_path, nproc, flags):
    """Saved by PP=2 under Ett|ttL after the iteration-5 shrink (iteration 6), resumed
    under Et|tttL: losses and the final checkpoint (weights, Adam state) equal the
    uninterrupted run's to the bit. Under PP=1: losses to 1e-5, the same pruned neurons
    (zero in weights and Adam moments) and shapes in the final checkpoint. Measured,
    once neurons are pruned (fc1 / fc2 GEMMs with K or N = the kept count, not a multiple
    of the SIMD width) the pipeline size changes the last bits, masked and physical
    alike (iteration 8: 5.5359867811203 under PP=1 from scratch or resumed, 5.535986661911011
    under PP=2; unpruned runs agree to the bit across pipeline sizes). Likely MKL's
    alignment-dependent kernels (its conditional numerical reproducibility is off);
    not verified."""
    out, report = saved
    assert [e["iteration"] for e in report["events"] if e["kind"] == "dynamism"] == [5, 8]
    root = tmp_path / "load"
    shutil.copytree(out / "ckpt" / "iter_0000006", root / "iter_0000006")
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    saved_fc1 = _final_state_at(out / "ckpt", 6)["decoder.layers.mlp.linear_fc1.weight"]
    assert saved_fc1.shape == (4, 128, 32)  # full width in the checkpoint ...
    pruned = (saved_fc1 == 0).all(dim=2)
    assert 0.3 < pruned.float().mean() < 0.7  # ... zeros at the pruned neurons
    resumed = worker(nproc, SMALL + flags + ["--load", str(root), "--save", str(tmp_path / "ckpt")],
                     tmp_path)
    a, b = _final(out / "ckpt"), _final(tmp_path / "ckpt")
    assert a.keys() == b.keys()
    if nproc == 2:
        assert losses(resumed) == losses(report)[6:]
        assert [k for k in a if not torch.equal(a[k], b[k])] == []
    else:  # last bits differ (see above): the same neurons pruned, nothing revived
        assert losses(resumed) == pytest.approx(losses(report)[6:], rel=1e-5)
        assert {k: a[k].shape for k in a} == {k: b[k].shape for k in b}
        for key in ("decoder.layers.mlp.linear_fc1.weight",
                    "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
                    "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight"):
            assert torch.equal((a[key] == 0).all(dim=2), (b[key] == 0).all(dim=2)), key


def _final_state_at(root, iteration: int) -> dict:
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import read_tensors
    return read_tensors(str(root / f"iter_{iteration:07d}"))


# ---- one process: the module ---------------------------------------------------------------
def test_shrunk_layer_equals_masked_layer_and_loads_into_a_fresh_one():
    in_megatron_process(_check_shrunk_layer)


def _check_shrunk_layer(args):
    """A layer rebuilt from `shrunk_tensors` (what a round does) gives the masked layer's
    output and input gradient bit for bit, and the masked layer's gradients at the kept
    neurons; a fresh full-width layer loading its state takes the pruned width."""

    from dynmo_plugin.scenarios.gradual_pruning.live import shrunk_tensors
    from dynmo_plugin.scenarios.gradual_pruning.kernels import apply_mask_
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.migration.extra_state import carried_state, loadable_state
    from dynmo_plugin.megatron.training.model import layer_spec, transformer_config
    from dynmo_plugin.scenarios.gradual_pruning.layer import neuron_prunable_layer_spec
    cfg = transformer_config(args, Layout.uniform(args.num_layers, 1))
    spec = neuron_prunable_layer_spec(layer_spec())

    def build():
        return seeded_layer(spec, cfg)

    masked = build()
    fc1, fc2 = masked.mlp.linear_fc1, masked.mlp.linear_fc2
    keep = torch.rand(fc1.weight.shape[0], generator=torch.Generator().manual_seed(1)) >= 0.75
    with torch.no_grad():
        fc1.weight_mask &= keep[:, None]
        fc2.weight_mask &= keep[None, :]
        apply_mask_(fc1.weight, fc1.weight_mask)
        apply_mask_(fc1.bias, keep)
        apply_mask_(fc2.weight, fc2.weight_mask)
    tensors = shrunk_tensors(masked, carried_state(masked))
    physical = build()
    physical.load_state_dict(loadable_state(tensors), strict=True)
    p1, p2 = physical.mlp.linear_fc1, physical.mlp.linear_fc2
    assert p1.physical and p2.physical
    assert p1.weight.shape == (int(keep.sum()), 32) and p2.weight.shape == (32, int(keep.sum()))
    assert p1.sparsity == fc1.sparsity and p1.weight_mask.shape == fc1.weight_mask.shape
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))
    out_m, gx_m, g_m = _fwd_bwd(masked, x)
    out_p, gx_p, g_p = _fwd_bwd(physical, x)
    assert torch.equal(out_p, out_m) and torch.equal(gx_p, gx_m)
    assert torch.equal(g_p["mlp.linear_fc1.weight"], g_m["mlp.linear_fc1.weight"][keep])
    assert torch.equal(g_p["mlp.linear_fc2.weight"], g_m["mlp.linear_fc2.weight"][:, keep])
    assert shrunk_tensors(physical, carried_state(physical)) is None  # nothing left to drop
    again = build()  # a migration's receiver: built full width from the spec
    again.load_state_dict(physical.state_dict(), strict=True)
    assert torch.equal(_fwd_bwd(again, x)[0], out_p)


@pytest.mark.multiproc
def test_structured_bf16_pipeline_prunes_and_shrinks(tmp_path):
    """bf16 under PP=2: the neuron scores rank 0 gathers are fp32, and rank 0 used to
    receive them into buffers of the weights' dtype (bf16: half the bytes), which
    aborted rank 0 at the first round (measured at 453bafa: SIGABRT). Now the round
    runs and the layers shrink."""
    report = worker(2, SMALL + ["--pipeline-model-parallel-size", "2", "--bf16", "--test-dump-params"],
                    tmp_path)
    events = [e for e in report["events"] if e["kind"] == "dynamism"]
    assert [e["iteration"] for e in events] == [5, 8]
    params = _params(tmp_path)
    for layer in range(4):
        kept = round((1 - events[-1]["detail"]["sparsity"][str(layer + 1)]) * 128)
        assert params[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].shape == (kept, 32)
        assert params[f"decoder.layers.{layer}.mlp.linear_fc1.weight"].dtype == torch.bfloat16
