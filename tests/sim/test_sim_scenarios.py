"""Scenario generators: shapes, determinism, and the paper's parameters."""
from __future__ import annotations

import numpy as np
import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.scenarios import SCENARIOS, make_trajectory, trajectory_class


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("layers", [24, 48])
def test_every_scenario_is_deterministic_and_well_formed(name, layers):
    a, b = make_trajectory(name, num_layers=layers, seed=1), make_trajectory(name, num_layers=layers, seed=1)
    points = a.change_points(10000)
    assert points == sorted(points) and all(0 < p < 10000 for p in points) and points
    for it in [0, *points]:
        la, lb = a.load(it), b.load(it)
        for field in ("attn_linear", "mlp", "attn_core", "backward"):
            va = getattr(la, field)
            assert va.shape == (layers,) and np.all(va >= 0)
            np.testing.assert_array_equal(va, getattr(lb, field))


def test_paper_world_shapes():
    for name in ("gradual_pruning", "layer_freezing", "early_exit", "sparse_attention"):
        world = trajectory_class(name).world
        assert (world.dp, world.pp) == (30, 24)
    for name in ("moe", "mixture_of_depths"):
        world = trajectory_class(name).world
        assert (world.dp, world.pp) == (8, 16)


@pytest.mark.parametrize("final", [0.52, 0.79, 0.90])
def test_pruning_reaches_final_sparsity_inside_3000_7000(final):
    s = make_trajectory("pruning", num_layers=32, final_sparsity=final)
    assert s.change_points(10000)[0] == 3000 and s.change_points(10000)[-1] == 7000
    assert s.global_sparsity(2999) == 0.0
    assert s.global_sparsity(7000) == pytest.approx(final)
    per_layer = s.layer_sparsity(8000)
    assert per_layer.std() > 0.01  # global magnitude pruning is uneven across layers
    np.testing.assert_allclose(s.load(8000).mlp, 1 - per_layer)


def test_freezing_freezes_a_growing_front_prefix():
    s = make_trajectory("freezing", num_layers=32)
    frozen = [s.frozen_layers(it) for it in (0, 2000, 4000, 9000)]
    assert frozen == sorted(frozen) and frozen[0] == 0 and frozen[-1] == 24
    back = s.load(9000).backward
    assert np.all(back[:24] == 0) and np.all(back[24:] == 1)


def test_early_exit_survival_decays_with_depth():
    s = make_trajectory("early_exit", num_layers=24)
    surv = s.survival(9000)
    assert surv[0] == 1.0 and np.all(np.diff(surv) <= 0) and surv[-1] < 0.2
    np.testing.assert_array_equal(s.survival(0), np.ones(24))


def test_moe_and_mod_imbalance_means_match_the_paper_roughly():
    moe = make_trajectory("moe", num_layers=2000)
    assert moe.load(0).mlp.mean() - 1 == pytest.approx(0.25, abs=0.03)
    mod = make_trajectory("mod", num_layers=2000)
    routed = mod.tokens(0)[1::2]
    assert routed.mean() / 0.125 - 1 == pytest.approx(0.18, abs=0.03)


def test_sparse_attention_density_per_layer_in_range():
    s = make_trajectory("sparse_attention", num_layers=40)
    d = s.density(5000)
    assert np.all((0.05 <= d) & (d <= 0.5)) and len(set(d.round(6))) > 1
    np.testing.assert_array_equal(s.load(5000).mlp, np.ones(40))


@pytest.mark.parametrize("name,kwargs,match", [
    ("nope", {}, "unknown scenario"),
    ("pruning", {"final_sparsity": 1.5}, "final_sparsity"),
    ("pruning", {"bogus": 1}, "bogus"),
    ("mod", {"capacity": 0}, "capacity"),
])
def test_bad_scenario_parameters_are_user_errors(name, kwargs, match):
    with pytest.raises(UserError, match=match):
        make_trajectory(name, num_layers=8, **kwargs)
