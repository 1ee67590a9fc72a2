"""The exact balancer with an MTP block against brute force, and the MTP block in plans.

The oracle enumerates every decoder split and every MTP stage with itertools, keeps
the drawn inputs raw and does its own arithmetic (loads, memory, the empty-stage
rule, Megatron's MTP rules restated: after every decoder layer, one stage, never on the
first of several stages), so a bug in `Layout`, `metrics` or the solver shows up here.
Every layout the solver emits also passes Megatron-Core's own validator.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import BalanceProblem, InfeasibleError, solve
from dynmo_plugin.layout import Layout

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
REL_TOL = 1e-9


@dataclass(frozen=True)
class Case:
    costs: tuple[int, ...]
    p: int
    memory: tuple[int, ...]
    capacity: int | None
    extras_cost: tuple[int, ...]
    extras_memory: tuple[int, ...]
    k: int
    mtp_cost: int
    mtp_memory: int
    current: tuple[tuple[int, ...], int] | None  # (counts, mtp stage)
    allow_empty: bool

    def problem(self) -> BalanceProblem:
        cur = None if self.current is None else Layout(self.current[0], 1, self.k, self.current[1])
        return BalanceProblem(costs=self.costs, num_stages=self.p, memory=self.memory,
                              capacity=self.capacity, extras_cost=self.extras_cost,
                              extras_memory=self.extras_memory, current=cur,
                              allow_empty_stages=self.allow_empty, mtp_layers=self.k,
                              mtp_cost=self.mtp_cost, mtp_memory=self.mtp_memory)


def _splits(n: int, p: int):
    for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1):
        b = (0, *cuts, n)
        yield tuple(y - x for x, y in zip(b, b[1:]))


def _admissible(case: Case, counts: tuple[int, ...], s: int) -> bool:
    if case.p > 1 and s == 0:
        return False
    if any(counts[t] for t in range(s + 1, case.p)):
        return False
    if not case.allow_empty and any(counts[t] == 0 for t in range(s)):
        return False
    if not case.allow_empty and counts[s] == 0 and s == 0:
        return False
    total = sum(case.memory) + sum(case.extras_memory) + case.mtp_memory
    start = 0
    for t, c in enumerate(counts):
        mem = case.extras_memory[t] + sum(case.memory[start:start + c]) + (case.mtp_memory if t == s else 0)
        if case.capacity is not None and mem > case.capacity + REL_TOL * total:
            return False
        start += c
    return True


def _bottleneck(case: Case, counts: tuple[int, ...], s: int) -> int:
    loads, start = [], 0
    for t, c in enumerate(counts):
        loads.append(case.extras_cost[t] + sum(case.costs[start:start + c])
                     + (case.mtp_cost if t == s else 0))
        start += c
    return max(loads)


def _stage_of(counts: tuple[int, ...]) -> list[int]:
    return [t for t, c in enumerate(counts) for _ in range(c)]


def _moved(case: Case, counts: tuple[int, ...], s: int) -> tuple[int, int]:
    if case.current is None:
        n, p = len(case.costs), case.p
        base, extra = divmod(n, p)
        ref = (tuple(base + (t < extra) for t in range(p)), p - 1)
    else:
        ref = case.current
    moved = [i for i, (a, b) in enumerate(zip(_stage_of(ref[0]), _stage_of(counts))) if a != b]
    key = (sum(case.memory[i] for i in moved), len(moved))  # move bytes default to memory
    if ref[1] != s:
        key = (key[0] + case.mtp_memory, key[1] + case.k)
    return key


def brute_force(case: Case):
    """(optimal bottleneck, fewest (bytes, layers) moved at it), or None."""
    found = [(_bottleneck(case, c, s), _moved(case, c, s))
             for c in _splits(len(case.costs), case.p) for s in range(case.p)
             if _admissible(case, c, s)]
    if not found:
        return None
    best = min(b for b, _ in found)
    return best, min(m for b, m in found if b == best)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 7))
    p = draw(st.integers(1, 4))
    allow_empty = draw(st.booleans()) or n < p
    costs = tuple(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n)))
    memory = tuple(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    extras_cost = tuple(draw(st.lists(st.integers(0, 8), min_size=p, max_size=p)))
    extras_memory = tuple(draw(st.lists(st.integers(0, 3), min_size=p, max_size=p)))
    capacity = draw(st.one_of(st.none(), st.integers(4, 20)))
    k = draw(st.integers(1, 2))
    current = None
    if draw(st.booleans()):
        counts = draw(st.sampled_from(list(_splits(n, p))))
        last = max([t for t, c in enumerate(counts) if c] or [0])
        stages = [s for s in range(max(last, 1 if p > 1 else 0), p)]
        current = (counts, draw(st.sampled_from(stages)))
    return Case(costs, p, memory, capacity, extras_cost, extras_memory, k,
                draw(st.integers(0, 9)), draw(st.integers(0, 4)), current, allow_empty)


@SETTINGS
@given(cases())
def test_exact_with_mtp_equals_brute_force(case):
    want = brute_force(case)
    try:
        problem = case.problem()
        plan = solve(problem, "exact")
    except InfeasibleError:
        assert want is None, f"solver found no layout; brute force found {want}"
        return
    assert want is not None, f"solver returned {plan.layout}; brute force found none"
    layout = plan.layout
    got = (_bottleneck(case, layout.counts, layout.mtp_stage),
           _moved(case, layout.counts, layout.mtp_stage))
    assert _admissible(case, layout.counts, layout.mtp_stage), layout
    assert got == want, f"{layout}: {got} != brute force {want}"
    assert plan.bottleneck_after == pytest.approx(want[0])


@SETTINGS
@given(cases())
def test_every_layout_the_balancers_emit_passes_megatrons_validator(case):
    ppl = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    for method in ("exact", "partition", "diffusion", "uniform"):
        try:
            layout = solve(case.problem(), method).layout
        except InfeasibleError:
            continue
        text = layout.to_megatron()
        ppl.PipelineParallelLayerLayout(text, case.p).validate_layer_layout(
            num_layers=len(case.costs), mtp_num_layers=case.k)
        assert text.count("m") == case.k


def test_a_heavy_head_sends_the_block_standalone_and_the_plan_says_so():
    problem = BalanceProblem(costs=[1.0] * 8, num_stages=4, extras_cost=[0.5, 0, 0, 3.0],
                             mtp_layers=1, mtp_cost=1.5, mtp_memory=10.0,
                             current=Layout.uniform(8, 4, mtp_layers=1))
    plan = solve(problem, "exact")
    assert plan.layout.to_megatron() == "Ettt|ttt|ttm|L"
    assert (plan.bottleneck_before, plan.bottleneck_after) == (6.5, 3.5)
    assert [(m.kind, m.src, m.dst, m.bytes) for m in plan.moves if m.kind == "mtp"] == \
        [("mtp", 3, 2, 10.0)]
    assert "MTP block (1 layer(s)): standalone on stage 2 (rank 2), moved from stage 3" in str(plan)
    assert plan.to_dict()["moves"][-1]["kind"] == "mtp"


def test_a_light_head_keeps_the_block_on_the_last_rank():
    problem = BalanceProblem(costs=[2.0] * 8, num_stages=4, extras_cost=[0, 0, 0, 0.5],
                             mtp_layers=1, mtp_cost=1.0,
                             current=Layout.uniform(8, 4, mtp_layers=1))
    plan = solve(problem, "exact")
    assert plan.layout.mtp_stage == 3 and not plan.layout.mtp_standalone


def test_problem_and_current_must_agree_on_mtp():
    with pytest.raises(ValueError, match="has 1 MTP layers but the problem has 0"):
        BalanceProblem(costs=[1.0] * 4, num_stages=2, current=Layout.uniform(4, 2, mtp_layers=1))
    with pytest.raises(ValueError, match="no MTP layers"):
        BalanceProblem(costs=[1.0] * 4, num_stages=2, mtp_cost=1.0)


def _plan_cli(tmp_path, costs, *args):
    import json
    import subprocess
    import sys
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", str(path), *args],
                          capture_output=True, text=True)


def test_dynmo_plan_says_where_the_mtp_block_goes(tmp_path):
    import json
    costs = {"costs": [1.0] * 8, "mtp": {"layers": 1, "cost": 1.5, "memory": 10}}
    (tmp_path / "extras.json").write_text(json.dumps([0.5, 0, 0, 3.0]))
    out = _plan_cli(tmp_path, costs, "--method", "exact", "--current-layout", "Ett|tt|tt|ttmL",
                    "--extras", str(tmp_path / "extras.json"), "--microbatches", "8")
    assert out.returncode == 0, out.stderr
    assert "Ett|tt|tt|ttmL -> Ettt|ttt|ttm|L" in out.stdout
    assert "MTP block (1 layer(s)): standalone on stage 2 (rank 2), moved from stage 3" in out.stdout
    out = _plan_cli(tmp_path, costs, "--method", "exact", "--current-layout", "Ett|tt|tt|ttmL",
                    "--extras", str(tmp_path / "extras.json"), "--json")
    plan = json.loads(out.stdout)
    assert plan["layout"] == "Ettt|ttt|ttm|L" and plan["bottleneck_before"] == 6.5


@pytest.mark.parametrize("costs, args, message", [
    ({"costs": [1.0] * 4, "mtp": {"layers": 2}}, ["--current-layout", "Ett|ttmL"],
     "holds 1 MTP layers ('m') but the costs file's mtp.layers is 2"),
    ({"costs": [1.0] * 4, "mtp": {"layers": 0}}, ["--stages", "2"], "mtp.layers must be"),
    ({"costs": [1.0] * 4}, ["--current-layout", "Etm|ttL"], "follow every decoder layer"),
    ({"costs": [1.0] * 4}, ["--current-layout", "Ettm|ttL"], "decoder layers after them"),
    ({"costs": [1.0] * 4, "mtp": {"layers": 1}}, ["--stages", "2", "--repack"], "--repack does not"),
])
def test_dynmo_plan_refuses_bad_mtp_inputs_in_one_line(tmp_path, costs, args, message):
    out = _plan_cli(tmp_path, costs, "--method", "exact", *args) if "--repack" not in args \
        else _plan_cli(tmp_path, costs, *args)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
