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
