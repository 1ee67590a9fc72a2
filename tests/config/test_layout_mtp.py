"""MTP layers ('m') in layout strings, against Megatron-Core 0.16.1's own validator.

Both directions over many generated strings: every string we accept, Megatron's
`PipelineParallelLayerLayout(...).validate_layer_layout` accepts too, and so does the
string we render from it; every string Megatron rejects we reject with one line. Where
we are stricter than Megatron, the test names the documented reasons (MTP on the first
rank, which Megatron's own message forbids but its v = 1 check lets through; 'E' not
opening the first stage) and fails on any other.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.layout import Layout, LayoutError

megatron_layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
PPLayout = megatron_layout.PipelineParallelLayerLayout

SETTINGS = settings(max_examples=400, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def megatron_accepts(text: str, pp: int, num_layers: int, mtp: int | None) -> bool:
    try:
        PPLayout(text, pp).validate_layer_layout(num_layers=num_layers, mtp_num_layers=mtp)
    except (AssertionError, IndexError, KeyError, ValueError):
        return False
    return True


def ours(text: str, pp: int, v: int, num_layers: int, mtp: int | None) -> Layout | str:
    try:
        return Layout.parse(text, pp, num_layers, v, mtp or 0)
    except LayoutError as e:
        return str(e)


# Near-valid stages: E?, t*, m*, L? mostly in order, sometimes shuffled.
_stage = st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 2), st.booleans(),
                   st.integers(0, 9))


def _render(stage: tuple) -> str:
    e, t, m, ell, shuffle = stage
    chars = list(("E" if e else "") + "t" * t + "m" * m + ("L" if ell else ""))
    if shuffle == 0:
        random.Random(len(chars) * 7 + t).shuffle(chars)
    return "".join(chars)


@st.composite
def generated(draw):
    pp = draw(st.integers(1, 4))
    v = draw(st.integers(1, 3))
    stages = [_render(draw(_stage)) for _ in range(pp * v)]
    # most strings get their E and L where Megatron wants them, so that MTP rules are hit
    if draw(st.integers(0, 3)):
        stages = [s.replace("E", "").replace("L", "") for s in stages]
        stages[0] = "E" + stages[0]
        stages[-1] = stages[-1] + "L"
    text = "|".join(stages)
    n = text.count("t") + draw(st.sampled_from([0, 0, 0, 1]))
    k = text.count("m") + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    return text, pp, v, n, (k if k > 0 else None)


def _stricter_reason(text: str, pp: int, v: int) -> str | None:
    """Why we may reject a string Megatron accepts: the documented stricter rules."""
    stages = text.split("|")
    rank0 = [stages[c * pp] for c in range(v)]
    if pp > 1 and any("m" in s for s in rank0):
        return "MTP on the first rank"
    if not stages[0].startswith("E"):
        return "E not opening the first stage"
    return None


@SETTINGS
@given(generated())
def test_both_directions_against_megatron(case):
    text, pp, v, n, k = case
    theirs = megatron_accepts(text, pp, n, k)
    got = ours(text, pp, v, n, k)
    if isinstance(got, Layout):
        assert theirs, f"we accept {text!r} (pp={pp}, layers={n}, mtp={k}); Megatron rejects it"
        rendered = got.to_megatron()
        assert megatron_accepts(rendered, pp, n, k), rendered
        assert Layout.parse(rendered, pp, n, v, k or 0) == got
        assert got.mtp_standalone == PPLayout(rendered, pp).validate_layer_layout(n, k)
    else:
        assert "\n" not in got and got.startswith("layout "), got
        if theirs:
            assert _stricter_reason(text, pp, v), f"we reject {text!r} that Megatron accepts: {got}"


def _all_placements(n_max: int = 4):
    """Every MTP placement of every decoder split, pp <= 4, v <= 2, k <= 2."""
    for pp in (1, 2, 3, 4):
        for v in (1, 2):
            stages = pp * v
            for n in range(0, n_max + 1):
                for counts in _compositions(n, stages):
                    for k in (1, 2):
                        for s in range(stages):
                            yield pp, v, counts, k, s


def _compositions(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, parts - 1):
            yield (first, *rest)


def test_every_mtp_placement_we_build_megatron_validates_and_every_other_is_one_line():
    accepted = rejected = 0
    for pp, v, counts, k, s in _all_placements():
        parts = ["t" * c for c in counts]
        parts[s] += "m" * k
        parts[0] = "E" + parts[0]
        parts[-1] += "L"
        text = "|".join(parts)
        theirs = megatron_accepts(text, pp, sum(counts), k)
        try:
            layout = Layout(counts, v, k, s)
        except LayoutError as e:
            rejected += 1
            assert "\n" not in str(e)
            assert not theirs or (pp > 1 and s % pp == 0), (text, str(e))
            assert isinstance(ours(text, pp, v, sum(counts), k), str)
            continue
        accepted += 1
        assert layout.to_megatron() == text
        assert theirs, text
    assert accepted > 500 and rejected > 500, (accepted, rejected)


@pytest.mark.parametrize("text, pp, v, message", [
    ("Etm|L", 2, 1, "first pipeline rank"),
    ("Ett|tmt|L", 3, 1, "follow every decoder layer"),
    ("Et|m|t|L", 4, 1, "decoder layers after them in stage 2"),
    ("Et|tm|m|L", 4, 1, "one (virtual) stage"),
    ("Et|tm||L", 2, 2, "last chunk of their rank"),
    ("Ett|ttmL", 2, 1, "--mtp-num-layers is 2"),
    ("Ett|ttxL", 2, 1, "unsupported characters ['x']"),
])
def test_violations_name_the_rule(text, pp, v, message):
    got = ours(text, pp, v, text.count("t"), 2 if "--mtp" in message else text.count("m"))
    assert isinstance(got, str) and message in got, got


def test_megatron_accepts_mtp_on_the_first_rank_without_interleaving_and_we_do_not():
    """The one place we are stricter on MTP, pinned so that a Megatron change shows."""
    assert megatron_accepts("Ettm|L", 2, 2, 1)
    assert isinstance(ours("Ettm|L", 2, 1, 2, 1), str)


def test_mtp_queries_and_repack_padding():
    layout = Layout.parse("Ett|tm|L", 3, 3, 1, 1)
    assert (layout.mtp_stage, layout.mtp_rank, layout.mtp_standalone) == (1, 1, True)
    assert Layout.parse("Ett|ttmL").mtp_standalone is False
    assert Layout.uniform(4, 2, mtp_layers=1).to_megatron() == "Ett|ttmL"
    assert layout.padded(4).to_megatron() == "Ett|tm||L"
    assert isinstance(ours("Et|t|tm|L", 2, 2, 3, 1), str)  # rank 0's last chunk
    assert Layout.parse("Et|t|t|mL", 2, 3, 2, 1).padded(3).to_megatron() == "Et|t||t|m|L"
    assert layout.mtp_moved(Layout.parse("Ett|t|mL")) is True
    assert layout.mtp_moved(layout) is False


def _run_config(argv):
    import argparse

    from dynmo_plugin.config import add_dynmo_args, add_model_args
    from dynmo_plugin.megatron.training.machine import load_run_config
    parser = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    return load_run_config(parser.parse_args(argv))


def test_mtp_num_layers_from_flags_and_yaml(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  num_layers: 4\n  mtp_num_layers: 1\n  pipeline_model_parallel_size: 2\n")
    cfg = _run_config(["--dynmo-config", str(path)])
    assert cfg.model.mtp_num_layers == 1
    cfg = _run_config(["--dynmo-config", str(path), "--mtp-num-layers", "2",
                       "--pipeline-model-parallel-layout", "Ett|ttmm|L",
                       "--pipeline-model-parallel-size", "3"])
    assert cfg.model.mtp_num_layers == 2


@pytest.mark.parametrize("argv, needle", [
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ett|ttL"],
     "holds 0 MTP layers ('m') but --mtp-num-layers is 1"),
    (["--pipeline-model-parallel-layout", "Ett|ttmL"], "holds 1 MTP layers ('m') but --mtp-num-layers is 0"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Ettm|ttL"],
     "decoder layers after them"),
    (["--mtp-num-layers", "0"], "mtp_num_layers"),
])
def test_mtp_config_errors_are_one_line(argv, needle):
    from dynmo_plugin.config import ConfigError
    with pytest.raises(ConfigError) as err:
        _run_config(["--num-layers", "4", "--pipeline-model-parallel-size", "2", *argv])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_repack_with_mtp_needs_untied_embeddings_and_a_live_repack():
    """A live repack carries the block onto the last surviving rank (untied embeddings,
    one chunk per rank); tied or in checkpoint mode it is refused in one line."""
    from dynmo_plugin.config import ConfigError
    base = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--mtp-num-layers", "1",
            "--dynmo", "--dynmo-repack"]
    for extra, why in (([], "tied embeddings"),
                       (["--untie-embeddings-and-output-weights", "--dynmo-repack-mode",
                         "checkpoint", "--save", "ckpt"], "--dynmo-repack-mode checkpoint")):
        with pytest.raises(ConfigError, match=f"--mtp-num-layers and {why}: a repack carries") as err:
            _run_config(base + extra)
        assert "\n" not in str(err.value)
    assert _run_config(base + ["--untie-embeddings-and-output-weights"]).dynmo.repack.enabled


def test_a_forced_live_block_move_with_virtual_stages_is_refused_in_one_line():
    """One chunk per rank: the block moves live (tests/megatron/test_mtp_live_moves.py);
    with virtual stages decoder layers move around it and a layout moving it is refused."""
    from dynmo_plugin.config import ConfigError
    with pytest.raises(ConfigError, match="puts the MTP block on rank 2 but it starts on rank 3; "
                                          "with virtual pipeline stages") as err:
        _run_config(["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                     "--num-virtual-stages-per-pipeline-rank", "2", "--mtp-num-layers", "1",
                     "--dynmo", "--dynmo-forced-layouts", "3:Et|t|t|t|t|t|ttm|L"])
    assert "\n" not in str(err.value)
