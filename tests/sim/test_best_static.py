"""The best static choice (issue 38): split tuned once, pipeline sized once, the freed
GPUs as data parallelism from the start; the bar is never below Megatron's uniform
split or the tuned split alone, over random problems."""
from __future__ import annotations

import random

import pytest

from dynmo_plugin.balancing.grow import grown_dp
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.best_static import StaticChoice, pick, static_choices
from dynmo_plugin.sim.campaign import CampaignConfig, run_variants
from dynmo_plugin.scenarios import SCENARIOS, make_trajectory

TOL = 1e-12
BARS = ("static", "static_tuned", "packed_once", "best_static", "best_static_per_gpu")


def _random_problems(n: int, seed: int = 38):
    rng = random.Random(seed)
    for _ in range(n):
        pp = rng.choice((2, 3, 4, 6, 8))
        yield dict(name=rng.choice(sorted(SCENARIOS)), layers=pp * rng.choice((1, 2, 3, 4)), pp=pp,
                   dp=rng.choice((1, 2, 4, 8)), iterations=rng.choice((1000, 3000, 6000)),
                   seed=rng.randrange(1000))


@pytest.mark.parametrize("problem", list(_random_problems(24)), ids=lambda p: "{name}-{layers}-{pp}-{dp}".format(**p))
def test_best_static_is_never_below_uniform_or_tuned(problem):
    cfg = CampaignConfig(scenario=make_trajectory(problem["name"], num_layers=problem["layers"],
                                                  seed=problem["seed"]),
                         dp=problem["dp"], pp=problem["pp"], iterations=problem["iterations"],
                         baselines=BARS)
    b = run_variants(cfg, {"": {}})[""].baselines
    best, per_gpu = b["best_static"], b["best_static_per_gpu"]
    for bar in ("static", "static_tuned"):
        # best by tokens/s on at most pp x dp GPUs: no worse in either measure
        assert best.tokens_per_s >= b[bar].tokens_per_s * (1 - TOL)
        assert best.tokens_per_gpu_s >= b[bar].tokens_per_gpu_s * (1 - TOL)
        assert per_gpu.tokens_per_gpu_s >= b[bar].tokens_per_gpu_s * (1 - TOL)
    assert per_gpu.tokens_per_gpu_s >= b["packed_once"].tokens_per_gpu_s * (1 - TOL)
    assert best.gpus_avg <= cfg.dp * cfg.pp


class _Summary:
    def __init__(self, tokens_per_s: float, gpus: int):
        self.tokens_per_s, self.tokens_per_gpu_s = tokens_per_s, tokens_per_s / gpus


def test_candidates_follow_the_grow_arithmetic():
    """8 stages at dp 2 (16 ranks), 32 micro-batches per replica, packed to 4: grown
    candidates at every K the 16 ranks split into (1, 2, 4; not 3, 5, 6, 7), each on
    16 / K replicas running 64 x K / 16 micro-batches (the global batch unchanged);
    the decision's own layout at its K, the exact split (`split_at`) at the others."""
    uniform, packed = Layout.uniform(16, 8), Layout.uniform(16, 4)
    seen, asked = [], []

    def run_fixed(layout, dp, m):
        seen.append((layout.num_stages, dp, m))
        return _Summary(1.0, layout.num_stages * dp)

    def split_at(k):
        asked.append(k)
        return Layout.uniform(16, k)

    out = static_choices(uniform=uniform, tuned=uniform, packed=packed, dp=2, num_microbatches=32,
                         run_fixed=run_fixed, split_at=split_at)
    assert list(out) == ["uniform", "tuned", "packed", "grown_1", "grown_2", "grown_4"]
    assert asked == [1, 2]
    assert seen[3:] == [(1, 16, 4), (2, 8, 8), (4, grown_dp(8, 4, 2), 16)]
    assert out["grown_4"].layout is packed and all(c.gpus == 16 for n, c in out.items() if n != "packed")


def test_pick_by_objective_and_refusals():
    lay = Layout.uniform(8, 4)
    a = StaticChoice("a", lay, 2, 8, _Summary(100.0, 8))
    b = StaticChoice("b", Layout.uniform(8, 2), 2, 8, _Summary(90.0, 4))
    assert pick({"a": a, "b": b}, "tokens_per_s") is a
    assert pick({"a": a, "b": b}, "tokens_per_gpu_hour") is b
    assert pick({"a": a, "c": StaticChoice("c", lay, 2, 8, _Summary(100.0, 8))}) is a  # a tie: the first
    with pytest.raises(UserError, match="objective"):
        pick({"a": a}, "speed")
    with pytest.raises(UserError, match="no candidate"):
        pick({})
