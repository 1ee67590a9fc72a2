"""The simulated DynMo's freed ranks: the live `choose_freed` on simulated timings
(release, grow, auto), and a campaign that repacks and grows (issue 38)."""
from __future__ import annotations

import pytest

from dynmo_plugin.balancing import RepackCriteria
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.campaign import CampaignConfig, run_variants
from dynmo_plugin.sim.freed import freed_step
from dynmo_plugin.scenarios import make_trajectory


def _step(mode, layout, *, grow_s=0.5, release_s=1.0, objective="min_stages", dp=2, m=32):
    calls = []

    def iteration_s(d, mb):
        calls.append((d, mb))
        return release_s if d == dp else grow_s

    return freed_step(mode=mode, objective=objective, stages_before=8, layout_after=layout, dp=dp,
                      num_microbatches=m, tokens_per_iteration=1e6, iteration_s=iteration_s), calls


def test_grow_keeps_every_rank_and_the_global_batch():
    step, calls = _step("grow", Layout.uniform(16, 4))
    assert step.grown and (step.dp, step.num_microbatches) == (4, 16)  # 8 x 2 / 4; 32 x 2 / 4
    assert sorted(calls) == [(2, 32), (4, 16)]
    assert step.choice.ranks_grow == 16 and step.choice.ranks_release == 8


def test_release_and_auto_follow_the_objective():
    lay = Layout.uniform(16, 4)
    release, _ = _step("release", lay)
    assert not release.grown and (release.dp, release.num_microbatches) == (2, 32)
    fast, _ = _step("auto", lay, grow_s=0.5)  # 2x tokens/s on 2x the GPUs: min_stages grows
    assert fast.grown
    slow, _ = _step("auto", lay, grow_s=1.0)  # no faster: release
    assert not slow.grown and not slow.refused
    per_gpu, _ = _step("auto", lay, grow_s=0.6, objective="throughput_per_gpu")  # faster, not per GPU
    assert not per_gpu.grown


def test_an_uneven_split_refuses_grow_and_releases_under_auto():
    lay = Layout.uniform(18, 6)  # 16 ranks do not split into 6 stages
    grow, calls = _step("grow", lay)
    assert grow.refused and "do not split" in grow.choice.reason and calls == [(2, 32)]
    auto, _ = _step("auto", lay)
    assert not auto.grown and not auto.refused and (auto.dp, auto.num_microbatches) == (2, 32)
    with pytest.raises(ValueError, match="freed must be one of"):
        _step("keep", lay)


def _campaign():
    cfg = CampaignConfig(scenario=make_trajectory("layer_freezing", num_layers=16), dp=2, pp=4,
                         iterations=6000, repack_criteria=RepackCriteria(max_slowdown=1.05),
                         baselines=("static", "best_static"))
    return run_variants(cfg, {f: {"repack": True, "freed": f} for f in ("release", "grow")})


def test_a_campaign_that_repacks_and_grows():
    res = _campaign()
    grown = [e for e in res["grow"].events if e.kind == "repack" and e.applied]
    assert [(e.layout_after, e.dp_after) for e in grown] == [("Etttttttttttt|ttttL", 4)]
    assert grown[0].freed.startswith("freed ranks: grow")
    assert res["grow"].dynmo.gpus_avg == pytest.approx(8.0)  # every rank kept
    # 4 -> 3 stages at iteration 2000 cannot grow (8 ranks into 3): refused, nothing moves
    refused = [e for e in res["grow"].events if e.kind == "repack" and not e.applied]
    assert refused and all("do not split" in e.reason and e.layout_after == e.layout_before
                           for e in refused)
    released = res["release"]
    assert released.dynmo.gpus_avg < 8.0
    assert all(e.dp_after == 2 for e in released.events)


def test_the_campaign_refuses_an_unknown_freed_mode():
    with pytest.raises(UserError, match="freed must be one of"):
        CampaignConfig(scenario=make_trajectory("layer_freezing", num_layers=8), dp=1, pp=2,
                       freed="keep")
