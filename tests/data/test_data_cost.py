"""The cost model's fits (pure): KnapFormer's k and gamma and AdaptiveLoad's p come back
from synthetic timings, held-out error ranks them against the token-count model, and
AdaptiveLoad's batch size follows its formula."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_plugin.data.cost_model import (CostSample, adaptive_batch_size, fit_adaptiveload,
                                          fit_knapformer, fit_tokens, held_out_error,
                                          samples_from_probe)


def _mixes(rng, n, max_len=2048):
    out = []
    for _ in range(n):
        tokens = int(rng.integers(256, max_len + 1))
        cuts = np.sort(rng.choice(np.arange(1, tokens), size=int(rng.integers(0, 8)), replace=False))
        out.append((tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [tokens]]))), tokens))
    return out


@settings(max_examples=25, deadline=None)
@given(k=st.floats(1e-12, 1e-8), gamma=st.floats(0.05, 5.0), seed=st.integers(0, 1000))
def test_knapformer_fit_recovers_k_and_gamma(k, gamma, seed):
    rng, d = np.random.default_rng(seed), 64
    samples = [CostSample(ls, t, k * (24 * t * d * d + gamma * 4 * d * sum(x * x for x in ls))
                          * (1 + 0.01 * rng.standard_normal())) for ls, t in _mixes(rng, 80)]
    fit = fit_knapformer(samples, d)
    assert fit.k == pytest.approx(k, rel=0.1) and fit.gamma == pytest.approx(gamma, rel=0.1)
    assert fit.alpha == pytest.approx(4 * fit.k * fit.gamma * d)
    assert fit.beta == pytest.approx(24 * fit.k * d * d)


def test_adaptiveload_finds_p_and_beats_the_token_model_held_out():
    rng = np.random.default_rng(0)
    mixes = _mixes(rng, 80)
    samples = [CostSample(ls, t, 0.01 + 2e-7 * sum(x ** 1.8 for x in ls)) for ls, t in mixes]
    fit = fit_adaptiveload(samples[:40])
    assert fit.p == pytest.approx(1.8) and fit.r2 > 0.999
    tok = fit_tokens(samples[:40])
    assert held_out_error(fit, samples[40:]) < 0.01 < held_out_error(tok, samples[40:])
    assert fit.doc_workload(100) == pytest.approx(fit.b * 100 ** 1.8)


def test_samples_from_probe_pairs_times_with_lengths():
    probe = {"fwd/3": [1.0, 2.0], "bwd/3": [2.0, 4.0]}
    s = samples_from_probe(probe, 3, [[5, 6], [11]], tokens=16)
    assert s == [CostSample((5, 6), 16, 3.0), CostSample((11,), 16, 6.0)]
    with pytest.raises(ValueError, match="micro-batches"):
        samples_from_probe(probe, 3, [[5]], tokens=16)


def test_adaptive_batch_size():
    assert adaptive_batch_size(512, 2.0, mem_tokens=8192, comp_budget=4 * 512 ** 2) == 4
    assert adaptive_batch_size(128, 2.0, mem_tokens=1024, comp_budget=1e12) == 8   # memory-bound
    assert adaptive_batch_size(4096, 2.0, mem_tokens=1024, comp_budget=1.0) == 1   # at least 1
    with pytest.raises(ValueError):
        adaptive_batch_size(0, 2.0, 1, 1)


def test_calibration_fit_record_from_gathered_samples():
    """Rank 0's fit over every rank's {layer: samples}: the asked-for form, held-out errors
    of all three, per-layer KnapFormer; too few samples keep the prior (no exception)."""
    from dynmo_plugin.megatron.profiling.calibration import fit_record
    from dynmo_plugin.data.cost_model import model_from_dict, model_to_dict
    rng, d, k, gamma = np.random.default_rng(3), 64, 2e-10, 1.5
    def samples(n):
        return [CostSample(ls, t, k * (24 * t * d * d + gamma * 4 * d * sum(x * x for x in ls)))
                for ls, t in _mixes(rng, n)]
    rec = fit_record([{1: samples(20)}, {2: samples(20)}], "knapformer", d, iteration=2)
    model = model_from_dict(rec["model"])
    assert model.k == pytest.approx(k, rel=1e-6) and model.gamma == pytest.approx(gamma, rel=1e-6)
    assert model_to_dict(model) == rec["model"] and rec["samples"] == 40
    assert rec["held_out_error"]["knapformer"] < 1e-6 < rec["held_out_error"]["tokens"]
    assert set(rec["per_layer_knapformer"]) == {"1", "2"}
    assert fit_record([{1: samples(2)}], "adaptiveload", d, 2)["model"] is None


def test_layer_costs_follow_the_length_mix_by_each_layers_model():
    """A profile timed over short documents, re-costed to a mix of long ones: the layer
    whose attention weighs more (gamma) grows more; without models nothing changes."""
    from dynmo_plugin.megatron.profiling.calibration import mix_adjusted_profile
    from dynmo_plugin.data.cost_model import KnapFormerCost
    from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile
    layers = [LayerProfile(layer=n, stage=0, fwd_s=1.0, bwd_s=2.0, param_bytes=0, grad_bytes=0,
                           optim_bytes=0, act_bytes=0) for n in (1, 2)]
    profile = PipelineProfile(layers=layers, stages=[])
    models = {1: KnapFormerCost(k=1e-9, gamma=0.5, hidden=64),
              2: KnapFormerCost(k=1e-9, gamma=4.0, hidden=64)}
    window, run = (4, 4 * 1024, 4 * 8 * 128.0 ** 2), (8, 8 * 1024, 8 * 1024.0 ** 2)
    out = mix_adjusted_profile(profile, models, window, run)
    ratio = {x.layer: x.cost_s / 3.0 for x in out.layers}
    for n, m in models.items():
        assert ratio[n] == pytest.approx(m.predict([1024], 1024) / m.predict([128] * 8, 1024))
    assert 1 < ratio[1] < ratio[2]
    assert mix_adjusted_profile(profile, {}, window, run) is profile
