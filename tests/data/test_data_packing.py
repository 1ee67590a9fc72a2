"""Packers (pure) and the packed stream: nothing lost or duplicated, caps kept, outlier
queues FIFO with a bounded delay, resumable state, and the packers' modules stay pure."""
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_plugin.data.documents import DocumentStream, LognormalDocuments
from dynmo_plugin.data.cost_model import (AdaptiveLoadCost, KnapFormerCost, PowerCost,
                                          adaptive_batch_size, adaptive_batch_sizes)
from dynmo_plugin.data.packing import (AdaptiveBatcher, OutlierQueues, SequentialPacker,
                                       WlbPacker, length_buckets)
from dynmo_plugin.data.stream import PackedDocuments

L = 512


def _stream(packer: str, dp=1, mb=4, thresholds=(), delay=3, count=400, redistribute=False):
    src = LognormalDocuments(seed=5, vocab_size=64, median=60, sigma=1.0, max_length=2 * L,
                             count=count)
    docs = DocumentStream(src, seed=5, max_length=L)
    p = (SequentialPacker(L, dp, mb) if packer == "sequential"
         else AdaptiveBatcher(L, dp, mb, length_buckets(L), 4 * L, PowerCost(2.0))
         if packer == "adaptive" else WlbPacker(L, dp, mb, lambda n: float(n) ** 2))
    q = OutlierQueues(list(thresholds), dp * mb, delay) if thresholds else None
    return PackedDocuments(docs, p, L, dp, mb, q,
                           redistribute=redistribute)


def _placed(plan):
    return [s for mb in plan.groups for ids in mb for s in ids]


@pytest.mark.parametrize("packer,thresholds,redistribute", [
    ("sequential", (), False), ("wlb", (), False), ("wlb", (200, 350), False),
    ("sequential", (), True), ("wlb", (200, 350), True), ("adaptive", (), False)])
@pytest.mark.parametrize("dp", [1, 2])
def test_no_document_lost_or_duplicated_over_an_epoch(packer, thresholds, redistribute, dp):
    stream = _stream(packer, dp=dp, thresholds=thresholds, redistribute=redistribute)
    trained, pulled, it = [], [], 0
    epoch = stream.stream._per_epoch
    while stream.cursor < epoch:
        it += 1
        plan = stream.plan(it)
        trained += _placed(plan)
        pulled += plan.pulled
        for mb in plan.lengths:
            assert len(mb) == dp
            if packer == "adaptive":  # one bucket per micro-batch, at most B(S) documents
                for x in mb:
                    S = stream.packer.bucket(max(x, default=1))
                    assert len(x) <= stream.packer.batch_sizes[S] and all(n <= S for n in x)
            else:
                assert all(sum(x) <= L for x in mb)
    waiting = set(plan.leftover) | set(plan.queued)
    assert len(trained) == len(set(trained))                       # nothing twice
    assert set(trained) | waiting == set(pulled) == set(range(stream.cursor))  # nothing lost
    assert not set(trained) & waiting


def test_outlier_delay_is_bounded_and_fifo():
    stream = _stream("wlb", thresholds=(200, 350), delay=3)
    seen_at, trained_at = {}, {}
    for it in range(1, 60):
        plan = stream.plan(it)
        for s in plan.pulled:
            seen_at[s] = it
        for s in _placed(plan):
            trained_at[s] = it
    waits = [trained_at[s] - seen_at[s] for s in trained_at]
    long_docs = [s for s in trained_at if stream.stream.piece(s).length >= 200]
    assert long_docs and max(trained_at[s] - seen_at[s] for s in long_docs) <= 3 + 2
    assert max(waits) <= 5  # a carried-over short document goes first the next iteration
    q = OutlierQueues([10, 20], num_bins=2, max_delay=2)
    for sid, n in [(1, 12), (2, 25), (3, 13)]:
        assert q.admit(sid, n)
    assert not q.admit(4, 5)
    assert q.release() == [(1, 12), (3, 13)]     # level 0 full (2 bins): both, in order
    q.tick()
    assert q.release() == []
    q.tick()
    assert q.release() == [(2, 25)]              # waited max_delay
    with pytest.raises(ValueError, match="ascending"):
        OutlierQueues([20, 10], 2, 1)


def test_state_resumes_exactly():
    """Replaying the plans restores the stream while the cost model is the prior; the
    state (JSON) restores it with a fitted model and per-layer models too."""
    a = _stream("wlb", dp=2, thresholds=(200,))
    fresh = _stream("wlb", dp=2, thresholds=(200,))   # resuming by replay
    for it in range(1, 9):
        assert a.plan(it).groups == fresh.plan(it).groups
    a.set_cost_model(KnapFormerCost(k=1e-9, gamma=0.3, hidden=64))
    a.layer_models = {1: KnapFormerCost(k=2e-9, gamma=1.0, hidden=64)}
    state = json.loads(json.dumps(a.state_dict()))   # plain data
    b = _stream("wlb", dp=2, thresholds=(200,))
    b.load_state_dict(state)
    for it in range(9, 16):
        assert a.plan(it).groups == b.plan(it).groups
    assert b.cost_model == a.cost_model and b.layer_models == a.layer_models
    assert b.mix_total == a.mix_total
    plan = a.plan(15)
    squares = sum(n * n for mb in plan.lengths for x in mb for n in x)
    assert a.mix(15, 15) == plan.mix == (2 * 4, 2 * 4 * L, float(squares))
    with pytest.raises(ValueError, match="outlier queues"):
        _stream("wlb", dp=2).load_state_dict(state)


def test_redistribution_evens_replicas_after_sequential_packing():
    def spread(stream):
        out = []
        for it in range(1, 30):
            per_rank = [sum(x * x for mb in stream.plan(it).lengths for x in mb[r]) for r in range(2)]
            out.append(max(per_rank) / np.mean(per_rank))
        return float(np.mean(out))
    plain, moved = _stream("sequential", dp=2), _stream("sequential", dp=2, redistribute=True)
    assert spread(moved) < spread(plain)
    assert any(moved.plan(it).moves for it in range(25, 30))


def test_wlb_balances_predicted_workload_better_than_sequential():
    def ratio(stream):
        r = []
        for it in range(1, 40):
            c = [sum(x * x for x in ids) + 1.0 for mb in stream.plan(it).lengths for ids in mb]
            r.append(max(c) / np.mean(c))
        return float(np.mean(r))
    seq, wlb = ratio(_stream("sequential", mb=8)), ratio(_stream("wlb", mb=8))
    wlb_q = ratio(_stream("wlb", mb=8, thresholds=(250,), delay=8))
    assert wlb < seq and wlb_q < wlb


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=0, max_size=40), dp=st.integers(1, 3),
       mb=st.integers(1, 4))
def test_packers_place_each_sample_at_most_once_under_the_cap(lengths, dp, mb):
    samples = [(100 + i, n) for i, n in enumerate(lengths)]
    for packer in (SequentialPacker(64, dp, mb), WlbPacker(64, dp, mb, lambda n: n ** 2)):
        groups = packer.get_groups_and_subsamples(samples)
        assert len(groups) == mb and all(len(g) == dp for g in groups)
        placed = [s for g in groups for ids in g for s in ids]
        assert sorted(placed + packer.leftover) == sorted(s for s, _ in samples)
        size = dict(samples)
        assert all(sum(size[s] for s in ids) <= 64 for g in groups for ids in g)
    if sum(lengths) <= 64:  # everything fits one bin: the greedy packer places it all
        wlb = WlbPacker(64, dp, mb, lambda n: n)
        wlb.get_groups_and_subsamples(samples)
        assert wlb.leftover == []


def test_packer_rejects_samples_longer_than_a_micro_batch():
    with pytest.raises(ValueError, match="do not fit"):
        SequentialPacker(8, 1, 1).get_groups_and_subsamples([(0, 9)])


_PROBE = """
import importlib, json, sys
for m in ("packing", "cost_model", "documents", "tokenizer"):
    importlib.import_module("dynmo_plugin.data." + m)
print(json.dumps(sorted(sys.modules)))
"""


def test_pure_modules_import_neither_torch_nor_megatron():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "megatron")]


def test_adaptive_batches_follow_the_fitted_model():
    """B(S) is AdaptiveLoad's formula with M_comp = cost of one full row; a fitted model
    set on the stream changes the batches formed next; rows are padded per bucket."""
    model = AdaptiveLoadCost(a=0.01, b=3e-7, p=1.8, r2=1.0)
    sizes = adaptive_batch_sizes(model, length_buckets(L), 4 * L, L)
    assert sizes == {S: adaptive_batch_size(S, 1.8, 4 * L, L ** 1.8) for S in length_buckets(L)}
    assert sizes[L] == 1 and sizes[64] == min(4 * L // 64, int((L / 64) ** 1.8))
    stream = _stream("adaptive", mb=4)
    assert stream.packer.batch_sizes == {64: 32, 128: 16, 256: 4, 512: 1}  # prior p = 2
    stream.set_cost_model(model)
    assert stream.packer.batch_sizes == sizes
    plan = stream.plan(1)
    shapes = set()
    for ids in (mb[0] for mb in plan.groups):
        batch = stream.build([plan.pieces[s] for s in ids])
        B, S = batch["tokens"].shape
        shapes.add((B, S))
        assert S == stream.packer.bucket(max(batch["lengths"])) and B == len(ids) <= sizes[S]
        assert batch["loss_mask"].sum(1).tolist() == [float(n) for n in batch["lengths"]]
        assert stream.cost_shape(batch["lengths"]) == ([S] * B, S * B)
    assert len(shapes) > 1
