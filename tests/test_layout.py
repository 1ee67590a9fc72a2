"""dynmo_plugin.layout against hand-written layouts and enumeration: what Megatron's layout
strings mean (--pipeline-model-parallel-layout), which rank and chunk each virtual stage
is (Megatron: stage s on rank s % pp, chunk s // pp), and where a padded layout puts each
layer. Every plan, repack and migration reads a Layout; a wrong count here moves the
wrong layers."""
import dataclasses

import pytest
from hypothesis import given, strategies as st

from dynmo_plugin.layout import Layout, LayoutError


@pytest.mark.parametrize("text,counts,chunks", [
    ("Ett|ttL", (2, 2), 1),
    ("E|tttL", (0, 3), 1),
    ("E(tt|)*3ttL", (2, 2, 2, 2), 2),
    ("E(t|)*3tL", (1, 1, 1, 1), 1),
    ("Et*3|t*2L", (3, 2), 1),
    ("E(t)*12|L", (12, 0), 1),
    ("E t, t | t L", (2, 1), 1),
])
def test_megatron_strings(text, counts, chunks):
    layout = Layout.parse(text, num_chunks=chunks)
    assert layout.counts == counts and layout.num_chunks == chunks
    assert Layout.parse(layout.to_megatron(), num_chunks=chunks) == layout


@pytest.mark.parametrize("text,args,needle", [
    ("Etm|tL", {}, "MTP layers must follow every decoder layer"),
    ("Etx|tL", {}, "unsupported characters ['x']"),
    ("tt|ttL", {}, "the embedding 'E' must open the first stage"),
    ("Ett|EttL", {}, "the embedding 'E' must open the first stage"),
    ("Ett|tt", {}, "the loss 'L' must close the last stage"),
    ("Ett|tt|ttL", {"num_stages": 2}, "has 3 stages but the pipeline has 2"),
    ("Et|t|t|tL", {"num_stages": 2}, "--num-virtual-stages-per-pipeline-rank 2"),
    ("Et|t|tL", {"num_chunks": 2}, "not a multiple of 2"),
    ("Ett|ttL", {"num_layers": 5}, "holds 4 decoder layers but --num-layers is 5"),
    # a mistyped repeat count was expanded in memory first (MemoryError on every rank)
    ("E|t*99999999999999|L", {}, "its repeat counts (count 999999999999...) make more than 1048576"),
    ("E(t|)*600000tL", {}, "its repeat counts make more than 1048576"),
    ("E(t*1000000)*3L", {}, "its repeat counts make more than 1048576"),  # each under, together over
    ("E(t*1000000)*100000L", {}, "its repeat counts make more than 1048576"),
])
def test_bad_strings_say_why(text, args, needle):
    with pytest.raises(LayoutError) as err:
        Layout.parse(text, **args)
    assert needle in str(err.value)


def test_bad_counts_and_chunks_are_refused():
    for counts, chunks in (((), 1), ((2, -1), 1), ((2, 2), 0), ((2, 2), True), ((2, 2, 2), 2)):
        with pytest.raises(LayoutError):
            Layout(counts, chunks)
    with pytest.raises(LayoutError):
        Layout.uniform(4, 0)
    with pytest.raises(LayoutError):
        Layout.from_boundaries([0, 3, 2])


def test_uniform_and_boundaries():
    assert Layout.uniform(10, 4).counts == (3, 3, 2, 2)        # remainder to the first stages
    assert Layout.uniform(3, 4).counts == (1, 1, 1, 0)
    assert Layout.from_boundaries([0, 2, 2, 7]).counts == (2, 0, 5)
    assert Layout((2, 0, 5)).boundaries == [0, 2, 2, 7]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=4), st.integers(1, 3))
def test_stages_ranks_chunks_and_layers_by_enumeration(per_rank, chunks):
    counts = tuple(per_rank * chunks)
    pp, layout = len(per_rank), Layout(tuple(per_rank * chunks), chunks)
    layer_stage = [s for s, c in enumerate(counts) for _ in range(c)]   # 0-based layer -> stage
    assert layout.num_ranks == pp and layout.num_stages == pp * chunks
    assert layout.interleaved == (chunks > 1) and layout.num_layers == sum(counts)
    assert layout.assignment() == layer_stage
    for s in range(len(counts)):
        assert (layout.rank_of(s), layout.chunk_of(s)) == (s % pp, s // pp)
        assert layout.stage_of(s % pp, s // pp) == s
        assert layout.offset(s) == sum(counts[:s])
        assert layout.layers_of(s) == [n + 1 for n, st_ in enumerate(layer_stage) if st_ == s]
    for r in range(pp):
        assert layout.rank_stages(r) == [s for s in range(len(counts)) if s % pp == r]
        assert sorted(layout.rank_layers(r)) == [n + 1 for n, st_ in enumerate(layer_stage)
                                                 if st_ % pp == r]


@pytest.mark.parametrize("text,chunks,ranks,expected", [
    ("Ett|ttL", 1, 3, "Ett|tt|L"),                 # the docstring's examples
    ("Et|t|t|tL", 2, 3, "Et|t||t|t|L"),
    ("Et|tt|t|ttL", 2, 4, "Et|tt|||t|tt||L"),
    ("Ett|ttL", 1, 2, "Ett|ttL"),
])
def test_padded_keeps_each_layer_on_its_rank_and_chunk(text, chunks, ranks, expected):
    layout = Layout.parse(text, num_chunks=chunks)
    padded = layout.padded(ranks)
    assert padded.to_megatron() == expected and padded.num_chunks == chunks
    for n in range(layout.num_layers):
        s, t = layout.assignment()[n], padded.assignment()[n]
        assert (layout.rank_of(s), layout.chunk_of(s)) == (padded.rank_of(t), padded.chunk_of(t))
    with pytest.raises(LayoutError, match="cannot spread"):
        layout.padded(layout.num_ranks - 1)


def test_moved_layers_by_enumeration():
    a, b = Layout((3, 1, 2)), Layout((1, 3, 2))
    assert a.moved_layers(b) == [(2, 0, 1), (3, 0, 1)]
    assert a.moved_layers(a) == []
    with pytest.raises(LayoutError, match="layers"):
        a.moved_layers(Layout((3, 2)))
    with pytest.raises(LayoutError, match="virtual stages per rank"):
        Layout((1, 1, 2, 2), 2).moved_layers(Layout((1, 1, 2, 2)))
    assert Layout((1, 1, 2, 2)).with_chunks(2) == Layout((1, 1, 2, 2), 2)


def test_a_layout_is_a_value():
    """Plans, the trainer and the controller share Layouts: one that changes in place
    changes all of them. Immutable, and equal layouts are one dict key."""
    layout = Layout((2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.counts = (3, 1)
    assert {layout: 1}[Layout((2, 2))] == 1 and Layout((2, 2)) != Layout((2, 2), 2)
    assert str(layout) == "Ett|ttL" and Layout([2, 2]).counts == (2, 2)
