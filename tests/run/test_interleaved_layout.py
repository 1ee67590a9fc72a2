"""Layouts with virtual stages (interleaved pipeline): Megatron's numbering, strings,
validation; and the balancers over virtual stages with per-rank memory caps."""
from __future__ import annotations

import pytest

from dynmo_plugin.layout import Layout, LayoutError


def test_virtual_stage_numbering_follows_megatron():
    lay = Layout.parse("Et|tt|tt|tL", num_stages=2, num_layers=6, num_chunks=2)
    assert lay.counts == (1, 2, 2, 1) and lay.num_chunks == 2
    assert (lay.num_stages, lay.num_ranks, lay.interleaved) == (4, 2, True)
    assert [lay.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert [lay.chunk_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert lay.stage_of(1, 1) == 3 and lay.rank_stages(0) == [0, 2]
    assert lay.rank_layers(0) == [1, 4, 5] and lay.rank_layers(1) == [2, 3, 6]
    assert lay.to_megatron() == "Et|tt|tt|tL" and str(lay) == "Et|tt|tt|tL"
    assert Layout.parse("E(tt|)*3ttL", 2, 8, num_chunks=2).counts == (2, 2, 2, 2)


def test_chunks_are_part_of_identity_and_moves():
    a = Layout((2, 2, 2, 2), 2)
    assert a != Layout((2, 2, 2, 2)) and a == Layout.uniform(8, 4, 2)
    assert a.with_chunks(1) == Layout((2, 2, 2, 2))
    b = Layout((1, 3, 2, 2), 2)
    assert a.moved_layers(b) == [(2, 0, 1)]  # rank 0 -> rank 1: communication
    c = Layout((2, 2, 3, 1), 2)
    assert [(n, c.rank_of(s), c.rank_of(d)) for n, s, d in a.moved_layers(c)] == [(7, 1, 0)]
    with pytest.raises(LayoutError, match="virtual stages per rank"):
        a.moved_layers(Layout((2, 2, 2, 2)))


@pytest.mark.parametrize("text, pp, layers, chunks, match", [
    ("Et|tt|tt|tL", 2, 6, 1, "num-virtual-stages-per-pipeline-rank 2"),
    ("Ett|ttL", 2, 4, 2, r"has 2 stages but the pipeline has 4"),
    ("Et|t|tL", None, 3, 2, "not a multiple of 2"),
    ("Et|tt|tt|tL", 2, 7, 2, "--num-layers is 7"),
    ("tE|tt|tt|tL", 2, 6, 2, "'E' must open"),
])
def test_bad_virtual_layouts_are_named(text, pp, layers, chunks, match):
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text, pp, layers, num_chunks=chunks)


@pytest.mark.parametrize("chunks", [0, -1, True, 1.5])
def test_bad_chunk_counts(chunks):
    with pytest.raises(LayoutError, match="num_chunks"):
        Layout((1, 1), chunks)
    with pytest.raises(LayoutError, match="cannot be split into 3"):
        Layout((1, 1, 1, 1), 3)


# ---- balancing over virtual stages: against brute force ----------------------------------
# The oracle enumerates every split of n layers into pp * v contiguous virtual stages and
# does its own arithmetic: virtual stage s is on rank s % pp; a rank's memory is the sum
# of its chunks; a move costs (its bytes, 1 layer) only when the layer changes RANK.
import itertools  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dynmo_plugin.balancing import BalanceProblem, InfeasibleError, solve  # noqa: E402
from dynmo_plugin.balancing.exact import bottleneck_layout  # noqa: E402

SETTINGS = settings(max_examples=120, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _splits(n, stages, empty):
    lo = 0 if empty else 1
    for cuts in itertools.combinations_with_replacement(range(n + 1), stages - 1):
        b = (0, *cuts, n)
        if all(y - x >= lo for x, y in zip(b, b[1:])):
            yield b


@st.composite
def interleaved_cases(draw):
    v = draw(st.integers(2, 3))
    pp = draw(st.integers(1, 6 // v))
    stages = pp * v
    empty = draw(st.booleans())
    n = draw(st.integers(1 if empty else stages, 8))
    ints = lambda k, hi: draw(st.lists(st.integers(0, hi), min_size=k, max_size=k))  # noqa: E731
    costs, memory = ints(n, 6), ints(n, 5)
    extras_cost, extras_memory = ints(stages, 3), ints(stages, 3)
    cap = draw(st.none() | st.lists(st.integers(1, 25), min_size=pp, max_size=pp))
    current = draw(st.sampled_from(list(_splits(n, stages, empty))))
    m = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(pp=pp, v=v, empty=empty, costs=costs, memory=memory, extras_cost=extras_cost,
                extras_memory=extras_memory, cap=cap, current=current, m=m)


def _iteration(c, b):
    """Megatron's interleaved iteration as the gate predicts it, by the oracle's own
    arithmetic: m x the busiest rank's chunks + (pp - 1) x the busiest virtual stage."""
    pp, stages = c["pp"], c["pp"] * c["v"]
    loads = [c["extras_cost"][s] + sum(c["costs"][b[s]:b[s + 1]]) for s in range(stages)]
    return c["m"] * max(sum(loads[r::pp]) for r in range(pp)) + (pp - 1) * max(loads)


def _fits(c, b):
    pp, stages = c["pp"], c["pp"] * c["v"]
    mem = [0.0] * pp
    for s in range(stages):
        mem[s % pp] += c["extras_memory"][s] + sum(c["memory"][b[s]:b[s + 1]])
    tol_mem = 1e-9 * (sum(c["memory"]) + sum(c["extras_memory"]))
    return c["cap"] is None or all(m <= k + tol_mem for m, k in zip(mem, c["cap"]))


def _oracle(c):
    """The least predicted iteration over the layouts that fit every rank, None if none."""
    fitting = [_iteration(c, b) for b in _splits(len(c["costs"]), c["pp"] * c["v"], c["empty"])
               if _fits(c, b)]
    return min(fitting) if fitting else None


def _relaxation(c):
    """Which note the solver owes (module docstring of balancing/exact.py, "Interleaved"):
    its relaxation lets each chunk use its rank's whole cap; a layout optimal there that
    fits every rank is optimal. ("optimal" if every relaxed optimum fits every rank,
    "bind" if none does, None if some do (the tie-break decides), relaxed optimum T_r);
    (None, None) when the relaxation has no layout."""
    pp, stages = c["pp"], c["pp"] * c["v"]
    scored = []
    for b in _splits(len(c["costs"]), stages, c["empty"]):
        chunk = [c["extras_memory"][s] + sum(c["memory"][b[s]:b[s + 1]]) for s in range(stages)]
        if c["cap"] is not None and any(m > c["cap"][s % pp] for s, m in enumerate(chunk)):
            continue
        rank = [sum(chunk[s] for s in range(r, stages, pp)) for r in range(pp)]
        fits = c["cap"] is None or all(m <= k for m, k in zip(rank, c["cap"]))
        scored.append((max(c["extras_cost"][s] + sum(c["costs"][b[s]:b[s + 1]]) for s in range(stages)), fits))
    if not scored:
        return None, None
    best = min(load for load, _ in scored)
    fits = {ok for load, ok in scored if load == best}
    return ("optimal" if fits == {True} else "bind" if fits == {False} else None), best


def _problem(c):
    from dynmo_plugin.layout import Layout
    counts = tuple(y - x for x, y in zip(c["current"], c["current"][1:]))
    return BalanceProblem(costs=c["costs"], num_stages=c["pp"] * c["v"], num_chunks=c["v"],
                          memory=c["memory"], capacity=c["cap"], extras_cost=c["extras_cost"],
                          extras_memory=c["extras_memory"], allow_empty_stages=c["empty"],
                          current=Layout(counts, c["v"]), num_microbatches=c["m"])


def _measured(c, layout):
    pp = c["pp"]
    b = layout.boundaries
    mem = [0.0] * pp
    for s in range(layout.num_stages):
        mem[s % pp] += c["extras_memory"][s] + sum(c["memory"][b[s]:b[s + 1]])
    load = max(c["extras_cost"][s] + sum(c["costs"][b[s]:b[s + 1]]) for s in range(layout.num_stages))
    return load, mem


@SETTINGS
@given(interleaved_cases())
def test_interleaved_exact_against_brute_force(c):
    """Sound always (per-rank caps honoured, stages non-empty where required); never
    predicted slower than the current layout when it fits, nor than the optimal-bottleneck
    layout the descent starts from; "optimal" only when it is, and otherwise bounds that
    hold the true optimum (balancing/interleaved.py)."""
    try:
        pb = _problem(c)
    except InfeasibleError:  # a rank's fixed extras alone exceed its cap
        assert _oracle(c) is None
        return
    want = _oracle(c)
    owed, relaxed = _relaxation(c)
    try:
        plan = solve(pb, "exact")
    except InfeasibleError as e:
        if relaxed is None:     # no layout even with each chunk given its rank's whole cap
            assert want is None
        else:                   # the relaxation had one; it did not fit, nor did the even split
            assert "per-rank memory caps bind" in str(e) and owed != "optimal"
        return
    assert want is not None, "a layout was returned where none fits"
    b = plan.layout.boundaries
    assert plan.layout.num_chunks == c["v"] and _fits(c, b)
    assert c["empty"] or min(plan.layout.counts) >= 1
    got = _iteration(c, b)
    tol = 1e-9 * (c["m"] + c["pp"]) * (sum(c["costs"]) + sum(c["extras_cost"])) + 1e-12
    assert plan.predicted_iter_s_after == pytest.approx(got)
    assert got >= want - tol
    if _fits(c, c["current"]):
        assert got <= _iteration(c, c["current"]) + tol
        if got >= _iteration(c, c["current"]) - tol:  # no better: nothing leaves its rank
            assert plan.bytes_moved == 0
    assert got <= _iteration(c, bottleneck_layout(pb)[0].boundaries) + tol
    said, start = plan.notes
    if "is optimal" in said:
        assert got == pytest.approx(want, abs=tol)
    else:
        lower, upper = (float(x) for x in said.split("within [")[1].split("]")[0].split(", "))
        assert lower - 1e-6 <= want <= upper + 1e-6 and upper == pytest.approx(got, rel=1e-5)
    if owed == "optimal":       # always so uncapped: a relaxed optimum that fits starts it
        assert start == "from the optimal bottleneck over virtual stages"
    elif owed == "bind":
        assert "per-rank memory caps bind" in start


def test_the_current_layout_is_a_start_of_the_descent():
    """Layers (3, 5, 3, 3, 0, 2), 4 micro-batches: the descent from the optimal-bottleneck
    layout stops at `Et|t|tt|ttL` (predicted 42) while the current `Ett|tt|t|tL` predicts
    40. Started from the current layout too, the plan is never slower than staying."""
    from dynmo_plugin.balancing.interleaved import descend
    pb = BalanceProblem(costs=[3, 5, 3, 3, 0, 2], num_stages=4, num_chunks=2, num_microbatches=4,
                        current=Layout.parse("Ett|tt|t|tL", 2, 6, 2))
    start, lower, _ = bottleneck_layout(pb)
    assert descend(pb, [start], lower).iteration_s == 42
    plan = solve(pb, "exact")
    assert plan.predicted_iter_s_before == 40 and plan.predicted_iter_s_after <= 40


@SETTINGS
@given(interleaved_cases(), st.sampled_from(["partition", "diffusion", "uniform"]))
def test_interleaved_heuristics_honour_rank_caps_or_refuse(c, method):
    """A layout that breaks no rank's cap, or a refusal: never one where none fits, and
    never a refusal without caps when a layout exists."""
    want = _oracle(c)
    try:
        plan = solve(_problem(c), method)
    except InfeasibleError as e:
        assert want is None or c["cap"] is not None, e
        return
    assert want is not None, "a layout was returned where none fits"
    _, mem = _measured(c, plan.layout)
    if c["cap"] is not None:
        assert all(m <= k + 1e-6 for m, k in zip(mem, c["cap"]))
    assert plan.layout.num_chunks == c["v"]


def test_rank_cap_binds_across_chunks():
    """Each chunk alone fits rank 0, both together do not: the relaxation's layout is
    rejected and the even split's is returned, with its bounds in the notes."""
    pb = BalanceProblem(costs=[1, 1, 1, 1, 1, 1, 1, 1], num_stages=4, num_chunks=2,
                        memory=[4, 4, 1, 1, 4, 4, 1, 1], capacity=[9, 100],
                        current=Layout((2, 2, 2, 2), 2))
    plan = solve(pb, "exact")
    mem0 = sum(pb.memory[n - 1] for n in plan.layout.rank_layers(0))
    assert mem0 <= 9 and "not proven optimal" in plan.notes[1]  # the start's bottleneck
    assert plan.migration_peak_memory is not None and len(plan.migration_peak_memory) == 2
    with pytest.raises(Exception, match="one per pipeline rank"):
        BalanceProblem(costs=[1] * 4, num_stages=4, num_chunks=2, capacity=[1, 1, 1, 1])
    # the calibrated overhead is per rank too: rank 0 keeps 9 - 1 = 8 bytes for its chunks
    kw = dict(costs=[1] * 8, num_stages=4, num_chunks=2, memory=[4, 4, 1, 1, 4, 4, 1, 1],
              capacity=[9, 100], current=Layout((2, 2, 2, 2), 2))
    plan = solve(BalanceProblem(**kw, memory_overhead=[1, 0]), "exact")
    assert sum(kw["memory"][n - 1] for n in plan.layout.rank_layers(0)) <= 8
    # the documented limit: with 7 bytes, rank 0 could hold {1} and {7} (4 + 1), but the
    # even split (3.5 per chunk) has no layout; the solver says so instead of guessing
    with pytest.raises(InfeasibleError, match="uneven chunks may exist"):
        solve(BalanceProblem(**kw, memory_overhead=[2, 0]), "exact")
    with pytest.raises(InfeasibleError, match="rank 0: fixed extras need 8 bytes plus a measured"):
        BalanceProblem(costs=[1] * 4, num_stages=4, num_chunks=2, capacity=[9, 9],
                       memory_overhead=[2, 0], extras_memory=[4, 0, 4, 0])


def test_local_moves_cost_no_bytes():
    pb = BalanceProblem(costs=[1, 1, 1, 1, 1, 1, 1, 9], num_stages=4, num_chunks=2,
                        memory=[5] * 8, current=Layout((2, 2, 2, 2), 2))
    plan = solve(pb, "exact")
    assert plan.layout.counts[-1] == 1
    for m in plan.moves:
        assert m.bytes == (0.0 if m.src % 2 == m.dst % 2 else 5.0)


# ---- the simulator evaluates interleaved layouts ------------------------------------------
def _sim_inputs(n=8):
    from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, layer_costs
    shape, hw = GPTShape(num_layers=n, hidden=256, heads=8, seq=256, vocab=1000), Hardware()
    load = LayerLoad.dense(n)
    return dict(costs=layer_costs(shape, hw, load), load=load, shape=shape, hw=hw)


def test_sim_interleaved_layout_shrinks_the_bubble():
    """Same 8 layers on 2 ranks, 4 micro-batches: v = 2 runs Megatron's interleaved
    schedule (bubble (p-1)/(v m) of the ideal instead of (p-1)/m)."""
    from dynmo_plugin.sim.pipeline import simulate_layout, stage_costs
    kw = _sim_inputs()
    plain = simulate_layout(layout=Layout.uniform(8, 2), dp=1, num_microbatches=4, **kw)
    inter = simulate_layout(layout=Layout.uniform(8, 4, 2), dp=1, num_microbatches=4, **kw)
    pc = stage_costs(layout=Layout.uniform(8, 4, 2), dp=1, num_microbatches=4, **kw)
    assert (pc.num_chunks, pc.num_stages, pc.num_virtual_stages) == (2, 2, 4)
    assert inter.bubble_ratio < plain.bubble_ratio
    assert inter.pipeline_s < plain.pipeline_s
    assert len(inter.timeline.ops[0]) == 2 * 4 * 2  # forward + backward, 4 micro-batches, 2 chunks


def test_sim_memory_counts_in_flight_chunks_per_rank():
    from dynmo_plugin.sim.pipeline import stage_memory_bytes
    kw = _sim_inputs()
    shape, hw = kw["shape"], kw["hw"]
    act = 34.0 * shape.seq * shape.micro_batch * shape.hidden
    plain = stage_memory_bytes(Layout((5, 3)), shape, hw, 4)
    emb = shape.vocab * shape.hidden * hw.state_bytes_per_param
    state = shape.layer_params * hw.state_bytes_per_param
    # 1F1B: rank r holds min(pp - r, m) micro-batches of its stage
    assert plain.tolist() == pytest.approx([5 * state + 2 * 5 * act + emb, 3 * state + 3 * act + emb])
    inter = stage_memory_bytes(Layout((1, 2, 3, 2), 2), shape, hw, 4)
    assert inter.shape == (2,)
    # rank 1 (stages 1, 3; 2 + 2 layers): warm-up 2*0 + (v-1)*pp = 2 forwards of chunk 0,
    # then F(chunk 0)... so at most 3 chunk-0 and 1 chunk-1 micro-batches: below 4 of both
    assert 4 * state + 4 * act + emb <= inter[1] <= 4 * state + 2 * 4 * act + emb


def test_padded_keeps_each_chunk_on_its_rank():
    """A repack's intermediate layout: the survivors' virtual stages over the old ranks."""
    assert str(Layout.parse("Ett|ttL").padded(4)) == "Ett|tt||L"
    wide = Layout.parse("Ettttt|t|t|tL", num_chunks=2).padded(4)
    assert str(wide) == "Ettttt|t|||t|t||L" and wide.num_ranks == 4 and wide.num_chunks == 2
    assert [wide.rank_layers(r) for r in range(4)] == [[1, 2, 3, 4, 5, 7], [6, 8], [], []]


# ---- the launcher's flags ----------------------------------------------------------------
def _config(argv, world_size=2):
    import argparse

    from dynmo_plugin.config import add_dynmo_args, add_model_args
    from dynmo_plugin.megatron.training.machine import load_run_config
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_dynmo_args(parser)
    return load_run_config(parser.parse_args(argv), world_size=world_size)


BASE = ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
        "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2"]


@pytest.mark.parametrize("extra, match", [
    (["--global-batch-size", "6"], r"micro-batches \(3 = .*multiple of --pipeline-model-parallel-size \(2\)"),
    (["--global-batch-size", "8", "--pipeline-model-parallel-layout", "Etttt|ttttL"],
     "has 2 stages but the pipeline has 4"),
    (["--global-batch-size", "8", "--dynmo", "--dynmo-repack", "--dynmo-forced-layouts",
      "3:Etttt|ttttL"], r"repacks onto 1 pipeline rank\(s\) keeping 2 virtual stages.*needs >= 2 ranks"),
    (["--global-batch-size", "8", "--dynmo", "--dynmo-forced-layouts", "2:Ettt|t|tt|ttL;3:Etttt|ttttL"],
     "has 2 stages but the pipeline has 4"),
])
def test_interleaved_flags_are_validated(extra, match):
    from dynmo_plugin.config import ConfigError
    with pytest.raises(ConfigError, match=match):
        _config(BASE + extra)


def test_interleaved_repack_needs_whole_micro_batch_groups():
    """pp = 4 -> 3 ranks: 4 micro-batches are no whole groups of 3; -> 2 ranks is accepted."""
    from dynmo_plugin.config import ConfigError
    flags = ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--global-batch-size",
             "8", "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2",
             "--dynmo", "--dynmo-repack", "--dynmo-forced-layouts"]
    with pytest.raises(ConfigError, match=r"the micro-batches \(4\) a multiple of the ranks"):
        _config(flags + ["3:Ett|tt|t|t|t|tL"], world_size=4)
    assert _config(flags + ["3:Ettttt|t|t|tL"], world_size=4).dynmo.repack.enabled
    assert _config(flags[:-1], world_size=4).dynmo.repack.enabled  # the planner decides


def test_interleaved_flags_accepted():
    cfg = _config(BASE + ["--global-batch-size", "8", "--pipeline-model-parallel-layout",
                          "Et|ttt|tt|ttL", "--dynmo", "--dynmo-forced-layouts", "2:Ettt|t|tt|ttL"])
    assert cfg.model.num_virtual_stages_per_pipeline_rank == 2
    with pytest.raises(Exception, match=r"needs --pipeline-model-parallel-size >= 2"):
        _config(["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8"], 1)
