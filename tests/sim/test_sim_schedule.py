"""The simulator against schedules computed by hand."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.cost import Link, PipelineCosts, ring_allreduce_s
from dynmo_plugin.sim.iteration import simulate_iteration
from dynmo_plugin.sim.schedule import interleaved, one_f_one_b, rank_orders, schedule_table


def _names(ops):
    return [str(o) for o in ops]


def test_1f1b_order_matches_megatron_warmup_steady_cooldown():
    # p=4, m=6: rank 0 warms up with 3 forwards, rank 3 starts 1F1B at once.
    assert _names(one_f_one_b(4, 6, 0)) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2",
                                            "B3", "B4", "B5"]
    assert _names(one_f_one_b(4, 6, 3)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3",
                                            "F4", "B4", "F5", "B5"]
    # fewer micro-batches than warm-up: all forwards then all backwards
    assert _names(one_f_one_b(4, 2, 0)) == ["F0", "F1", "B0", "B1"]


def test_interleaved_table_and_warmup_follow_megatron():
    # Megatron's own example in schedules.py: PP2 N3M5 with VP2 -> group of 3 then 2
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                       (3, 0), (4, 0), (3, 1), (4, 1)]
    ops = interleaved(2, 4, 0, 2)  # warm-up 2*(2-0-1) + (2-1)*2 = 4 virtual micro-batches
    assert _names(ops[:4]) == ["F0", "F1", "F0.1", "F1.1"]
    assert _names(ops[4:6]) == ["F2", "B0.1"]  # first backward runs the last chunk
    assert len(ops) == 2 * 4 * 2


def test_interleaved_rejects_group_smaller_than_pp():
    with pytest.raises(UserError, match="group size"):
        rank_orders(4, 2, num_chunks=2)


@pytest.mark.parametrize("p,m", [(1, 3), (2, 4), (4, 8), (4, 2), (3, 5), (8, 16)])
def test_equal_stages_take_m_plus_p_minus_1_slots(p, m):
    f, b = 1.0, 2.0
    r = simulate_iteration(PipelineCosts(fwd_s=[f] * p, bwd_s=[b] * p, num_microbatches=m))
    assert r.iteration_s == pytest.approx((m + p - 1) * (f + b))
    assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


def test_one_heavy_stage_dominates():
    # rank 2 costs 5+10 per micro-batch; the others 1+2. It starts after two light
    # forwards, never idles, and its last gradient crosses two light backwards:
    # 2*1 + 8*(5+10) + 2*2 = 126.
    r = simulate_iteration(PipelineCosts(fwd_s=[1, 1, 5, 1], bwd_s=[2, 2, 10, 2],
                                         num_microbatches=8))
    assert r.iteration_s == pytest.approx(126.0)
    assert r.idle_s[2] == pytest.approx(6.0)  # waits 2 at the start, 4 at the end
    assert r.busy_s.tolist() == [24.0, 24.0, 120.0, 24.0]


def test_interleaving_divides_the_bubble_by_chunks():
    # v=2 chunks of half the work: m(f+b) + (p-1)(f+b)/v = 8*3 + 3*1.5
    r = simulate_iteration(PipelineCosts(fwd_s=[0.5] * 8, bwd_s=[1.0] * 8, num_microbatches=8,
                                         num_chunks=2))
    assert r.iteration_s == pytest.approx(28.5)


def test_p2p_transfer_adds_per_hop_latency():
    # p=2, m=1: F0 | send | F0 B0 | send | B0  = 1 + 0.5 + 1 + 2 + 0.5 + 2
    link = Link(latency_s=0.5)
    r = simulate_iteration(PipelineCosts(fwd_s=[1, 1], bwd_s=[2, 2], num_microbatches=1,
                                         act_bytes=0, p2p=link))
    assert r.iteration_s == pytest.approx(7.0)


def test_ring_allreduce_model_and_its_place_after_the_flush():
    link = Link(latency_s=0.0, bandwidth_Bps=100.0)
    assert ring_allreduce_s(400, 4, link) == pytest.approx(2 * 3 / 4 * 4)
    assert ring_allreduce_s(400, 1, link) == 0.0
    r = simulate_iteration(PipelineCosts(fwd_s=[1, 1], bwd_s=[2, 2], num_microbatches=2, dp=4,
                                         grad_bytes=[400, 0], dp_link=link, tail_s=[0.5, 0.5]))
    # rank 0 finishes last (9.0), then all-reduces 6 s and steps 0.5 s
    assert r.pipeline_s == pytest.approx(9.0)
    assert r.iteration_s == pytest.approx(15.5)


def test_noise_is_seeded_and_keeps_order_of_magnitude():
    costs = PipelineCosts(fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, num_microbatches=8)
    a = simulate_iteration(costs, noise_sigma=0.1, seed=3)
    b = simulate_iteration(costs, noise_sigma=0.1, seed=3)
    assert a.iteration_s == b.iteration_s
    assert a.iteration_s != simulate_iteration(costs).iteration_s


@pytest.mark.parametrize("kwargs,match", [
    (dict(fwd_s=[1, -1], bwd_s=[1, 1], num_microbatches=2), "fwd_s"),
    (dict(fwd_s=[1, 1], bwd_s=[1], num_microbatches=2), "bwd_s"),
    (dict(fwd_s=[1, 1], bwd_s=[1, 1], num_microbatches=0), "num_microbatches"),
    (dict(fwd_s=[1, 1, 1], bwd_s=[1, 1, 1], num_microbatches=2, num_chunks=2), "chunks"),
    (dict(fwd_s=[1, 1], bwd_s=[1, 1], num_microbatches=2, grad_bytes=[1]), "grad_bytes"),
])
def test_bad_costs_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        PipelineCosts(**kwargs)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 10),
       f=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6),
       b=st.lists(st.floats(0.1, 5.0), min_size=6, max_size=6))
def test_iteration_is_bounded_by_busiest_stage_and_serial_time(p, m, f, b):
    costs = PipelineCosts(fwd_s=f[:p], bwd_s=b[:p], num_microbatches=m)
    r = simulate_iteration(costs)
    per_stage = [m * (x + y) for x, y in zip(f[:p], b[:p])]
    assert r.iteration_s >= max(per_stage) - 1e-9
    assert r.iteration_s <= sum(per_stage) + 1e-9
    assert 0.0 <= r.bubble_ratio < 1.0
