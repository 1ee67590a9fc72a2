"""Unit tests for `dynmo_plugin.scenarios.gradual_pruning.kernels` (single process, CPU, no timings).

The global-threshold oracle is a brute-force sort of every magnitude of every stage,
independent of the stage split; the sparse linear is checked against autograd through
a dense masked matmul. Tolerances: float64 rtol 1e-10 / atol 1e-12 (only summation
order differs), float32 rtol 1e-5 / atol 1e-5.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.scenarios.gradual_pruning import kernels as P

# torch warns once that CSR support is beta; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

SETTINGS = settings(max_examples=80, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5)}


# ------------------------------------------------------------------------ schedule

SCHED = dict(t0=10, n=8, dt=5, s_init=0.1, s_final=0.9)


def test_cubic_endpoints_and_clamping():
    c = lambda t: P.cubic_sparsity(t, **SCHED)  # noqa: E731
    assert c(0) == c(9) == c(10) == 0.1  # endpoints exact, not just approximately
    assert c(10 + 8 * 5) == c(10_000) == 0.9
    # half way (4 of 8 steps): S_f + (S_i - S_f) * (1/2)^3
    assert c(10 + 4 * 5) == pytest.approx(0.9 + (0.1 - 0.9) / 8)


def test_cubic_monotone_and_held_between_steps():
    values = [P.cubic_sparsity(t, **SCHED) for t in range(0, 70)]
    assert all(a <= b for a, b in zip(values, values[1:]))
    for k in range(8):
        start = 10 + 5 * k
        assert len({values[t] for t in range(start, start + 5)}) == 1
    changes = [t for t in range(1, 70) if values[t] != values[t - 1]]
    assert changes == [t for t in range(1, 70)
                       if P.is_pruning_step(t, SCHED["t0"], SCHED["n"], SCHED["dt"]) and t > 10]
    assert P.is_pruning_step(10, 10, 8, 5) and not P.is_pruning_step(11, 10, 8, 5)
    assert not P.is_pruning_step(55, 10, 8, 5)


@pytest.mark.parametrize("override,name", [
    (dict(n=0), "n"), (dict(dt=0), "dt"), (dict(t0=-1), "t0"), (dict(s_init=-0.1), "s_init"),
    (dict(s_final=1.5), "s_final"), (dict(s_init=0.95), "s_init"), (dict(n=2.5), "n"),
    (dict(t=True), "t"),
])
def test_cubic_rejects_bad_arguments(override, name):
    kwargs = dict(SCHED, t=12)
    kwargs.update(override)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        P.cubic_sparsity(**kwargs)


# ---------------------------------------------------------------- global threshold

@pytest.mark.parametrize("total,s,keep", [
    (10, 0.7, 3), (10, 0.9, 1), (100, 0.29, 71), (3, 0.5, 2), (0, 0.5, 0), (7, 0.0, 7),
    (7, 1.0, 0), (1000, 0.999, 1),
])
def test_num_to_keep_table(total, s, keep):
    assert P.num_to_keep(total, s) == keep


@SETTINGS
@given(st.integers(1, 10**7), st.data())
def test_num_to_keep_exact_fractions(total, data):
    j = data.draw(st.integers(0, total))
    assert P.num_to_keep(total, j / total) == total - j


def _stage_strategy():
    ints = st.lists(st.integers(-4, 4), min_size=1, max_size=12)           # many ties, zeros
    floats = st.lists(st.floats(-3, 3, width=32), min_size=1, max_size=12)
    tensor = st.one_of(ints, floats).map(lambda v: torch.tensor(v, dtype=torch.float32))
    return st.lists(st.lists(tensor, min_size=1, max_size=3), min_size=1, max_size=4)


@SETTINGS
@given(_stage_strategy(), st.data())
def test_global_threshold_matches_brute_force(stages, data):
    mags = sorted((abs(float(v)) for ws in stages for w in ws for v in w.tolist()), reverse=True)
    total = len(mags)
    s = data.draw(st.one_of(st.floats(0, 1), st.integers(0, total).map(lambda j: j / total)))
    keep = P.num_to_keep(total, s)

    cands = [P.local_candidates(ws, keep) for ws in stages]
    for ws, c in zip(stages, cands):
        assert c.numel() == min(keep, sum(w.numel() for w in ws))
    tau = P.global_threshold(cands, total, s)

    want = mags[keep - 1] if keep else math.inf
    assert tau == want
    kept = 0
    for ws in stages:
        for w in ws:
            m = P.magnitude_mask(w, tau)
            assert m.tolist() == [abs(float(v)) >= want for v in w.tolist()]
            kept += int(m.sum())
    assert kept >= keep  # ties at tau are kept
    if keep == total or mags[keep] != want:
        assert kept == keep


def test_ties_at_threshold_are_kept():
    stages = [[torch.tensor([3.0, -2.0])], [torch.tensor([2.0, 1.0]), torch.tensor([-2.0])]]
    keep = P.num_to_keep(5, 0.6)
    assert keep == 2
    tau = P.global_threshold([P.local_candidates(ws, keep) for ws in stages], 5, 0.6)
    assert tau == 2.0
    masks = [P.magnitude_mask(w, tau).tolist() for ws in stages for w in ws]
    assert masks == [[True, True], [True, False], [True]]  # 4 kept: every |w| == 2 stays


def test_threshold_rejects_short_candidates_and_prunes_all_at_one():
    w = [torch.arange(10.0)]
    with pytest.raises(ValueError, match="local_candidates"):
        P.global_threshold([P.local_candidates(w, 2)], 10, 0.5)
    assert P.global_threshold([P.local_candidates(w, 0)], 10, 1.0) == math.inf
    assert not P.magnitude_mask(w[0], math.inf).any()


# -------------------------------------------------------------------- sparse linear

def _mask(shape, sparsity, gen):
    numel = shape[0] * shape[1]
    keep = P.num_to_keep(numel, sparsity)
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[torch.randperm(numel, generator=gen)[:keep]] = True
    return mask.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sparsity", [0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("chunk_rows", [16, P.CHUNK_ROWS])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sparse_linear_matches_dense_masked(dtype, sparsity, chunk_rows, with_bias):
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 24, 40
    mask = _mask((out_f, in_f), sparsity, gen)
    w0 = torch.randn(out_f, in_f, generator=gen, dtype=dtype)   # nonzero OFF the mask too
    b0 = torch.randn(out_f, generator=gen, dtype=dtype) if with_bias else None
    x0 = torch.randn(37, 3, in_f, generator=gen, dtype=dtype)    # [s, b, h], 111 tokens
    g = torch.randn(37, 3, out_f, generator=gen, dtype=dtype)
    pattern = P.CsrPattern.from_mask(mask)
    assert pattern.nnz == int(mask.sum())

    def run(sparse):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if with_bias else None
        if sparse:
            y = P.SparseLinearFunction.apply(x, w, b, pattern, chunk_rows)
        else:
            y = x @ (w * mask).T + (b if with_bias else 0)
        (y * g).sum().backward()
        return y.detach(), x.grad, w.grad, (b.grad if with_bias else None)

    got, ref = run(True), run(False)
    for a, r in zip(got, ref):
        if r is not None:
            assert a.dtype == r.dtype and a.shape == r.shape
            assert torch.allclose(a, r, **TOL[dtype])
    assert torch.equal(got[2][~mask], torch.zeros(int((~mask).sum()), dtype=dtype))


def test_sparse_linear_uses_current_weight_values():
    """The CSR values are gathered per call: an optimizer-style in-place update shows up."""
    gen = torch.Generator().manual_seed(1)
    mask = _mask((8, 12), 0.9, gen)
    pattern = P.CsrPattern.from_mask(mask)
    w = torch.randn(8, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    P.masked_linear(x, w, mask, None, True, pattern=pattern)
    with torch.no_grad():
        w.add_(torch.randn(8, 12, generator=gen, dtype=torch.float64))
    y = P.masked_linear(x, w, mask, None, True, pattern=pattern)
    assert torch.allclose(y, x @ (w.detach() * mask).T, **TOL[torch.float64])


def test_masked_linear_paths_agree_and_crossover():
    gen = torch.Generator().manual_seed(2)
    mask = _mask((16, 16), 0.9, gen)
    w = torch.randn(16, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, generator=gen, dtype=torch.float64)
    x = torch.randn(4, 6, 16, generator=gen, dtype=torch.float64)
    dense = P.masked_linear(x, w, mask, b, False)
    sparse = P.masked_linear(x, w, mask, b, True)
    assert torch.allclose(dense, sparse, **TOL[torch.float64])
    dense.sum().backward()
    assert torch.equal(w.grad[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))
    assert not P.use_sparse(0.5) and not P.use_sparse(P.CROSSOVER) and P.use_sparse(0.9)


def test_sparse_linear_rejects_mismatched_shapes():
    mask = torch.ones(4, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="pattern shape"):
        P.masked_linear(torch.randn(2, 6), torch.randn(6, 4), mask.T, None, True,
                        pattern=P.CsrPattern.from_mask(mask))
    with pytest.raises(ValueError, match="in_features"):
        P.masked_linear(torch.randn(2, 5), torch.randn(4, 6), mask, None, True)


# ------------------------------------------------------- pruned weights stay at zero

def _adam_run(opt_cls, *, protect: bool, grad_mask_only: bool = False, amsgrad: bool = False):
    """Train dense 3 steps, prune half the weights, train 5 more; return (w, mask)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    x = torch.randn(32, 8, generator=gen, dtype=torch.float64)
    target = torch.randn(32, 8, generator=gen, dtype=torch.float64)
    opt = opt_cls([w], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)

    def step():
        opt.zero_grad()
        F.mse_loss(F.linear(x, w), target).backward()  # dense: grads nonzero everywhere
        opt.step()

    for _ in range(3):
        step()
    mask = P.magnitude_mask(w, P.global_threshold([P.local_candidates([w], 32)], 64, 0.5))
    P.apply_mask_(w, mask)
    if protect or grad_mask_only:
        P.register_grad_mask(w, mask)
    if protect:
        keys = P.zero_adam_state_(opt.state[w], mask)
        assert set(keys) == {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for _ in range(5):
        step()
    return w.detach(), mask


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_masks_and_zeroed_adam_state_keep_pruned_weights_exactly_zero(opt_cls, amsgrad):
    w, mask = _adam_run(opt_cls, protect=True, amsgrad=amsgrad)
    assert int((~mask).sum()) == 32
    assert torch.equal(w[~mask], torch.zeros(32, dtype=torch.float64))
    assert (w[mask] != 0).all()


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_without_protection_pruned_weights_resurrect(opt_cls):
    w, mask = _adam_run(opt_cls, protect=False)
    assert (w[~mask] != 0).all()
    # masking only the gradient is not enough: Adam's momentum moves them off zero
    w, mask = _adam_run(opt_cls, protect=False, grad_mask_only=True)
    assert (w[~mask] != 0).all()


def test_mask_helpers_check_sizes_and_accept_flat_shards():
    mask = torch.rand(4, 6) > 0.5
    state = {"step": torch.tensor(3.0), "exp_avg": torch.ones(24), "exp_avg_sq": torch.ones(24)}
    assert P.zero_adam_state_(state, mask) == ("exp_avg", "exp_avg_sq")
    assert torch.equal(state["exp_avg"], mask.reshape(-1).float())
    assert P.zero_adam_state_({}, mask) == ()
    with pytest.raises(ValueError, match="exp_avg"):
        P.zero_adam_state_({"exp_avg": torch.ones(5)}, mask)
    p = torch.full((4, 6), float("inf"))
    P.apply_mask_(p, mask)
    assert torch.equal(p == 0, ~mask)
    p.grad = torch.ones(4, 6)
    p.main_grad = torch.ones(4, 6)
    P.mask_grad_(p, mask)
    assert torch.equal(p.grad == 0, ~mask) and torch.equal(p.main_grad == 0, ~mask)


def test_grad_hook_follows_in_place_mask_update():
    w = torch.ones(3, 3, requires_grad=True)
    mask = torch.ones(3, 3, dtype=torch.bool)
    handle = P.register_grad_mask(w, mask)
    mask[0].fill_(False)
    (w * 2).sum().backward()
    assert torch.equal(w.grad[0], torch.zeros(3)) and torch.equal(w.grad[1:], torch.full((2, 3), 2.0))
    handle.remove()


# ------------------------------------------------------------------------- purity

def test_pruning_imports_no_distributed_or_megatron():
    """The pure modules of dynmo_plugin.scenarios (kernels, interface, registry, cost
    models) import no distributed or Megatron code. A scenario's live part and its layers
    are the glue that may: the registry imports them only when the scenario is chosen."""
    pkg = Path(P.__file__).parents[1]
    assert (pkg / "gradual_pruning" / "kernels.py").exists()
    for path in pkg.rglob("*.py"):
        if path.stem in ("live", "layer"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("torch.distributed", "megatron")), f"{path.name}: {name}"
                assert "dynmo_plugin.megatron" not in name, f"{path.name}: {name}"
