"""The simulator's grow prediction against a live 4-rank CPU run (issue 38): ONE launch.

configs/grow_check.yaml through the real launcher (torchrun, gloo, 4 ranks): layers 1-6
freeze at iteration 6, the frozen model trains on 4 stages, a forced repack at
iteration 13 packs it onto 2 stages and the freed ranks grow data parallelism to 2.
`sim.run_replay` predicts the tokens/s after the grow over before it from the run's
iteration-7 profile; the run measured it. While the run goes, scripts/grow_check.py's
LoadSampler records the cores other processes took, per iteration; each iteration is
predicted on the cores they left it.

TOLERANCE (25%, scripts/grow_check.py): CPU timing on this shared 2-core machine
scatters by +-20% per measurement, and the ratio holds two medians of 5 and 9
iterations taken a few seconds apart; the per-operation CPU cost of this VM moves
between the two stretches, which the one profile before the grow cannot know (the
grown stretch used -5% to +13% more CPU per iteration than the model in eight runs of
2026-11-28, docs/simulator.md "The ranks' other threads"). Measured while writing this (load average 43-97): predicted / measured - 1
between -14% and +7% load-corrected in five runs, -37% to +105% without the
correction (docs/simulator.md). A ratio, not a time: a load that slows both stretches
alike cancels, and the sampler accounts for one that does not.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from launch import ROOT, losses, train

from dynmo_plugin.cli import main as dynmo
from dynmo_plugin.sim.run_replay import replay_run

pytestmark = pytest.mark.multiproc

FROZEN = (1, 2, 3, 4, 5, 6)
CORES = float(min(len(os.sched_getaffinity(0)), 4))  # 4 ranks: more cores change nothing


@pytest.fixture(scope="module")
def grow_check():
    spec = importlib.util.spec_from_file_location("grow_check", ROOT / "scripts" / "grow_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["grow_check"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("grow_check", None)


@pytest.fixture(scope="module")
def grown(grow_check, tmp_path_factory):
    """(run dir, report, foreign cores per iteration) of the one launch."""
    out = tmp_path_factory.mktemp("grow_check")
    with grow_check.LoadSampler(out) as sampler:
        report = train(4, ["--dynmo", "--dynmo-config", str(grow_check.CONFIG)], out)
    return out, report, sampler.foreign_cores()


def test_the_run_freezes_then_repacks_and_grows(grown):
    _, report, foreign = grown
    (freeze,) = [e for e in report["events"] if e["kind"] == "dynamism"]
    assert freeze["iteration"] == 6 and tuple(freeze["detail"]["frozen_layers"]) == FROZEN
    applied = [e for e in report["events"] if e.get("applied")]
    assert [(e["iteration"], e["trigger"], e["layout_after"]) for e in applied] == [
        (13, "forced", "Ettttt|tttL")]
    repack = applied[0]["repack"]
    assert repack["freed"]["choice"] == "grow" and (repack["dp_before"], repack["dp_after"]) == (1, 2)
    assert [(h["iteration"], h["pp"], h["dp"], h["world_size"]) for h in report["world"]["history"]] == [
        (0, 4, 1, 4), (13, 2, 2, 4)]
    assert len(losses(report)) == 22
    assert set(range(1, 23)) <= set(foreign)  # the sampler saw every iteration


def test_the_replay_follows_the_run(grown):
    out, _, _ = grown
    replay = replay_run(out, cores=CORES)
    assert replay.profile_iteration == 7
    assert [(s.first, s.last, s.layout, s.pp, s.dp, s.num_microbatches, s.frozen, s.counted)
            for s in replay.segments] == [
        (1, 6, "Ett|tt|tt|ttL", 4, 1, 8, (), (3, 4, 5)),
        (7, 13, "Ett|tt|tt|ttL", 4, 1, 8, FROZEN, (8, 9, 10, 11, 12)),
        (14, 22, "Ettttt|tttL", 2, 2, 4, FROZEN, tuple(range(14, 23)))]
    for s in replay.segments:  # sharing cores is never faster than a device per rank
        assert s.predicted_s >= s.dedicated_s > 0
    g = replay.grow
    assert (g.iteration, g.before.first, g.after.first) == (13, 7, 14)


def _grow_line(out, foreign):
    """(the grow's load-corrected error, the line that says it) of one launch."""
    plain = replay_run(out, cores=CORES).grow
    g = replay_run(out, cores=CORES, foreign_cores=foreign).grow
    return g.error, (f"tokens/s after / before the grow: predicted {g.ratio():.3f}x on the cores left "
                     f"({g.before.cores:.2f} before, {g.after.cores:.2f} after), measured "
                     f"{g.ratio('measured'):.3f}x: {g.error:+.1%} (without the load correction "
                     f"{plain.error:+.1%}; one device per rank {g.ratio('dedicated'):.3f}x)")


def test_the_grow_prediction_is_within_tolerance(grown, grow_check, capsys, tmp_path):
    """One launch is one timing on a shared machine: a first measurement outside the
    tolerance is measured again by a second launch, and the test fails only if that one is
    outside too (CI of 2026-11-28, another session's mutation runs on the cores: +26.1%
    against 25%). A wrong model (e.g. the grow's dp ignored: 2x) fails both."""
    out, _, foreign = grown
    error, line = _grow_line(out, foreign)
    lines = [line]
    if abs(error) > grow_check.TOLERANCE:
        with grow_check.LoadSampler(tmp_path) as sampler:
            train(4, ["--dynmo", "--dynmo-config", str(grow_check.CONFIG)], tmp_path)
        error, line = _grow_line(tmp_path, sampler.foreign_cores())
        lines.append(f"measured again: {line}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert abs(error) <= grow_check.TOLERANCE, lines


def test_the_cli_prints_the_ratio(grown, capsys):
    out, _, _ = grown
    replay = replay_run(out, cores=2.0)
    assert dynmo(["simulate", "--from-run", str(out), "--cores", "2"]) == 0
    text = capsys.readouterr().out
    g = replay.grow
    assert (f"grow at iteration 13 (pp 4 -> 2, dp 1 -> 2): tokens/s after / before: predicted "
            f"{g.ratio():.3f}x, measured {g.ratio('measured'):.3f}x (medians of 5 and 9 iterations)") in text
    assert dynmo(["simulate", "--from-run", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["grow"]["ratio_measured"] == g.ratio("measured")
    assert doc["grow"]["ratio_predicted"] == g.ratio("dedicated")
