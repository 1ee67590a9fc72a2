"""The interleaved session of scripts/gpu_check.py (issue 34): programs started once take
turns round by round through a file baton (scripts/gpu_checks/baton.py), and the timings
leave out the warm-up, every round's first iteration (it follows a wait) and the --dynmo
run's profiling windows. The whole session with real programs (the launcher worker and
Megatron-LM's CPU harness) runs in the dry run (tests/scripts/test_gpu_check.py)."""
from __future__ import annotations

import threading
from pathlib import Path
import time
from types import SimpleNamespace

import pytest

from test_gpu_check import gpu_check  # noqa: F401 - puts scripts/ on the path

from gpu_checks import baton as bt  # noqa: E402
from gpu_checks import host_session, rows_mlm  # noqa: E402


def test_rounds_split_the_iterations():
    spec = bt.BatonSpec("f", "a", warmup=3, rounds=4, iters=8)
    assert spec.train_iters == 35
    assert [list(spec.iterations(r)) for r in (0, 1, 4)] == [[1, 2, 3], list(range(4, 12)), list(range(28, 36))]
    assert spec.first_iterations() == {1, 4, 12, 20, 28}
    assert spec.edges() == {1, 3, 4, 11, 12, 19, 20, 27, 28, 35}  # firsts (a wait) and lasts (the sync)
    assert [spec.round_of(i) for i in (1, 3, 4, 11, 12, 35)] == [
        (0, True, False), (0, False, True), (1, True, False), (1, False, True), (2, True, False), (4, False, True)]
    every = [i for r in range(5) for i in spec.iterations(r)]
    assert every == list(range(1, 36))  # each iteration in exactly one round


@pytest.mark.parametrize("rounds", [2, 4, 7])
def test_no_profiling_window_of_the_gpu_session_falls_on_a_rounds_first_iteration(rounds):
    """A round's first iteration runs cold after another program's turn: a window there
    gave stage_prediction[mlm-host] a profile unlike the iterations it is judged against
    (the plugin profiles every `every`-th iteration, each window one iteration);
    nor on its last (the hand-over's sync), nor right before it (the iteration after a
    window is timed on neither side of the plugin's on/off)."""
    s = host_session.GPU_SESSION
    spec = bt.BatonSpec("f", "a", s.warmup, rounds, s.dynmo_iters)  # the --dynmo program's
    windows = set(range(s.every, spec.train_iters + 1, s.every))
    assert len(windows) == rounds and not (windows | {w + 1 for w in windows}) & spec.edges()
    assert [spec.round_of(i)[0] for i in sorted(windows)] == list(range(1, rounds + 1))  # one in each


def _program(spec: bt.BatonSpec, record: list, work_s: float = 0.004):
    """A stand-in training loop (a thread): each iteration is a sleep, timed."""
    client = bt.BatonClient(spec, timeout_s=30)
    for it in range(1, spec.train_iters + 1):
        client.before(it)
        t0 = time.monotonic()
        time.sleep(work_s)
        record.append((spec.name, it, t0, time.monotonic()))
        client.after(it)


def test_programs_take_turns_and_never_run_at_once(tmp_path):
    names = ["launcher", "mlm", "mlm_dynmo"]
    baton = bt.Baton(tmp_path / "baton", names, rounds=3)
    record: list = []
    threads = [threading.Thread(target=_program, args=(bt.BatonSpec(str(baton.folder), n, 2, 3, 3), record))
               for n in names]
    for t in threads:
        t.start()
    baton.wait_ready(30, lambda: None)
    turns = baton.turns(30, lambda: None)
    for t in threads:
        t.join(10)
    assert [(t["round"], t["name"]) for t in turns] == [
        (0, "launcher"), (0, "mlm"), (0, "mlm_dynmo"), (1, "mlm"), (1, "mlm_dynmo"), (1, "launcher"),
        (2, "mlm_dynmo"), (2, "launcher"), (2, "mlm"), (3, "launcher"), (3, "mlm"), (3, "mlm_dynmo")]
    assert bt.overlaps(turns) == []
    # from the programs' own clocks: no two iterations of different programs overlap
    spans = sorted(record, key=lambda x: x[2])
    assert len(spans) == 3 * 11
    clashes = [(a[:2], b[:2]) for a, b in zip(spans, spans[1:]) if b[2] < a[3] and a[0] != b[0]]
    assert clashes == []
    # and each round's iterations ran in the program's turn, in round order
    order = [(name, bt.BatonSpec("f", name, 2, 3, 3).round_of(it)[0]) for name, it, *_ in spans]
    assert [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k] == [
        (t["name"], t["round"]) for t in turns]


def test_overlapping_turns_are_found():
    turns = [{"round": 0, "name": "a", "start": 0.0, "end": 10.0}, {"round": 0, "name": "b", "start": 1.0, "end": 2.0},
             {"round": 0, "name": "c", "start": 3.0, "end": 4.0}, {"round": 1, "name": "a", "start": 10.0, "end": 11.0}]
    assert bt.overlaps(turns) == [("a#0", "b#0"), ("a#0", "c#0")]


def test_a_program_that_dies_stops_the_session_at_once_with_its_reason(tmp_path):
    baton = bt.Baton(tmp_path / "baton", ["a", "b"], rounds=2)
    (baton.folder / "ready-a").write_text("")
    with pytest.raises(RuntimeError, match="b exit 1: Traceback") as e:  # not its 60 s timeout
        baton.wait_ready(60, lambda: "b exit 1: Traceback (log: x)")
    assert not isinstance(e.value, bt.BatonTimeout)
    with pytest.raises(bt.BatonTimeout, match="no done-a-0 after 0 s"):
        baton.turns(0.05, lambda: None)  # a program alive but never done: the turn's timeout


def test_the_session_waits_end_at_one_deadline_not_at_each_waits_own_limit(tmp_path):
    """Each wait used to get its full limit (the programs' readiness 240 s each in turn,
    every turn 120 s), so a session could outlast the budget several times over."""
    import time
    baton = bt.Baton(tmp_path / "baton", ["a", "b", "c"], rounds=1)
    start = time.monotonic()
    with pytest.raises(bt.BatonTimeout, match="no ready-a after 0 s"):
        baton.wait_ready(60, lambda: None, deadline=start + 0.2)
    for name in "abc":
        (baton.folder / f"ready-{name}").write_text("")
    (baton.folder / "done-a-0").write_text('{"start": 0, "end": 1}')
    with pytest.raises(bt.BatonTimeout, match="no done-b-0 after 0 s"):
        baton.turns(60, lambda: None, deadline=time.monotonic() + 0.2)
    assert time.monotonic() - start < 30  # not the waits' own 60 s


def test_a_program_without_a_coordinator_gives_up(tmp_path):
    client = bt.BatonClient(bt.BatonSpec(str(tmp_path), "a", 1, 1, 1), timeout_s=0.05)
    with pytest.raises(bt.BatonTimeout, match="no go-a-0"):
        client.before(1)
    assert (tmp_path / "ready-a").exists()


def _session(rounds: int = 4, lasting: float = 1.0, strays: tuple = ()) -> host_session.SessionResult:
    """Timings as a session records them at the GPU settings (3 warm-up iterations, rounds
    of 12, the --dynmo program's of 20 with a window every 20th): a round's first and last
    iteration hold the wait and the
    sync (seconds), a window 0.9 s, the iteration after a window 1.5x (a teardown);
    otherwise, in round r, times (1 + r/100): the launcher 0.10 s, pretrain_gpt.py 0.20 s,
    the --dynmo process (another process: 10% slower) 0.22 s without the plugin and 5%
    more with it (BatonSpec.plugin_runs), after round 1 times `lasting` on both sides (a
    cost the first window left). A median that kept any of these would move."""
    s = host_session.GPU_SESSION
    assert (s.warmup, s.iters, s.dynmo_iters, s.every) == (3, 12, 20, 20)  # the figures below
    spec = bt.BatonSpec("f", "launcher", s.warmup, rounds, s.iters)
    ab = bt.BatonSpec("f", "mlm_dynmo", s.warmup, rounds, s.dynmo_iters, alternate=s.every)
    windows = set(range(s.every, ab.train_iters + 1, s.every))

    def times(of: bt.BatonSpec, base: float, plugin: float = 1.0, after: float = 1.0) -> dict[int, float]:
        out = {}
        for r in range(rounds + 1):
            for i in of.iterations(r):
                on = of.alternate and of.plugin_runs(i)
                out[i] = (5.0 if i in of.edges() else 0.9 if on and i in windows
                          else 1.5 * base if of.alternate and i - 1 in windows
                          else base * (plugin if on else 1.0) * (1 + r / 100) * (after if r > 1 else 1.0))
        return out
    dynmo = times(ab, 0.22, plugin=1.05, after=lasting)
    launcher = {"iterations": [{"iteration": i, "time_s": t} for i, t in times(spec, 0.10).items()]}
    report = {"iterations": [{"iteration": i} for i in sorted(dynmo) if ab.plugin_runs(i) or i in strays],
              "events": [{"kind": "profile", "iteration": i, "window": [i, i], "profile": {"layers": []}}
                         for i in sorted(windows)]}
    return host_session.SessionResult(spec, ab, launcher, times(spec, 0.20), dynmo, report, [])


def test_the_plugin_is_timed_on_against_off_in_one_process_not_against_another_process():
    """The --dynmo program's own iterations without the plugin are the plugin's reference:
    the other process's level (here 10% off, as launches of one program differed on the
    H200) is printed as the draw, and does not enter the plugin's ratio; the iteration
    after a window is on neither side."""
    r = rows_mlm.session_ratios(_session())
    assert r.ours == pytest.approx([0.10 * (1 + k / 100) for k in (1, 2, 3, 4)])
    assert r.ratio == pytest.approx([0.5] * 4) and r.plugin == pytest.approx([1.05] * 4)
    assert r.draw == pytest.approx([1.10] * 4) and r.lasting == pytest.approx(1.0)
    assert r.pairs == pytest.approx([1.05] * 28)
    passed, detail = rows_mlm.throughput_verdict(r, "host", 20)
    assert not passed and ("--dynmo (every 20) plugin on/off in one process 1.050x (95% interval 1.050-1.050 over "
                           "28 pairs), over 1.03; the pairs summed 1.050x; by round 1.050 1.050 1.050 1.050 (rounds 1.050-1.050)") in detail
    assert "a cost windows leave in later steps (without the plugin, rounds 2+ over round 1" in detail
    times = host_session.timing_iterations(_session().dynmo, _session().dynmo_spec)
    assert max(times.values()) == 0.9 and 5.0 not in times.values() and 1 not in times
    on, off = rows_mlm.plugin_side(_session())  # 7 pairs a round, neighbours, the order flipped in round 2
    assert sorted(i for i in on if i <= 23) == list(range(6, 19, 2)) and sorted(i for i in off if i <= 23) == list(range(7, 20, 2))
    assert sorted(i for i in on if 24 <= i <= 43) == list(range(27, 40, 2))
    assert sorted(i for i in off if 24 <= i <= 43) == list(range(26, 39, 2))
    assert r.summed == pytest.approx(1.05)


def test_a_cost_the_first_window_leaves_in_every_later_step_shows_beside_the_on_off_ratio():
    """CUPTI left attached after a window slows on and off steps alike: on/off cannot see
    it. The --dynmo process's steps without the plugin, rounds 2+ over round 1 (before
    the first window), over the plain process's same ratio: 1.15 here."""
    r = rows_mlm.session_ratios(_session(lasting=1.15))
    assert r.plugin == pytest.approx([1.05] * 4) and r.lasting == pytest.approx(1.15)
    assert "over the plain process's same) 1.150x (printed, no verdict)" in rows_mlm.throughput_verdict(r, "host", 20)[1]


def test_a_plugin_that_ran_where_it_was_to_be_bypassed_voids_the_comparison():
    with pytest.raises(gpu_check.CheckFailed, match=r"ran on iterations \[5\] it was to skip"):
        rows_mlm.session_ratios(_session(strays=(5,)))


def test_the_plugin_runs_in_the_warm_up_on_every_other_iteration_flipped_by_round_and_in_every_window():
    """Pairs whose order flips from round to round: a drift within a round, or anything
    tied to an iteration's parity, reads as the plugin's cost in one round and against it
    in the next (scripts/overhead_power.py: with the plugin always first, a +-0.5% parity
    pattern fails a true 1.03 34% of the time, by turns 2%)."""
    ab = bt.BatonSpec("f", "mlm_dynmo", 3, 4, 20, alternate=20)  # rounds 4-23, 24-43, 44-63, 64-83
    off = [i for i in range(1, ab.train_iters + 1) if not ab.plugin_runs(i)]
    assert off == [*range(5, 24, 2), *range(24, 40, 2), *range(42, 44, 2), *range(45, 60, 2), *range(61, 64, 2),
                   *range(64, 80, 2), *range(82, 84, 2)]
    assert all(ab.plugin_runs(i) for i in range(20, ab.train_iters + 1, 20))  # every window
    assert all(bt.BatonSpec("f", "mlm", 3, 4, 20).plugin_runs(i) for i in range(1, 84))  # no alternate: always
    c = host_session.CPU_SESSION
    cpu = bt.BatonSpec("f", "mlm_dynmo", c.warmup, 4, c.dynmo_iters, alternate=c.every)
    windows = list(range(c.every, cpu.train_iters + 1, c.every))
    session = SimpleNamespace(  # the dry run's rounds: each times both sides
        dynmo_spec=cpu, dynmo=dict.fromkeys(range(1, cpu.train_iters + 1), 0.1),
        report={"iterations": [{"iteration": i} for i in range(1, cpu.train_iters + 1) if cpu.plugin_runs(i)],
                "events": [{"kind": "profile", "iteration": w, "window": [w, w], "profile": {"layers": []}}
                           for w in windows]})
    on, off = rows_mlm.plugin_side(session)
    for r in range(1, 5):
        assert set(cpu.iterations(r)) & on and set(cpu.iterations(r)) & off, (r, sorted(on), sorted(off))
    assert rows_mlm.plugin_pairs(session, on, off) == ([1.0] * 4, 1.0)


def test_each_program_gets_its_own_rounds_the_dynmo_programs_longer():
    for s, short, long in ((host_session.GPU_SESSION, 51, 83), (host_session.CPU_SESSION, 26, 34)):
        specs = {n: host_session.program_spec(Path("b"), n, s, 4) for n in host_session.PROGRAMS}
        assert {n: x.train_iters for n, x in specs.items()} == {"launcher": short, "mlm": short, "mlm_dynmo": long}
        assert [x.alternate for x in specs.values()] == [0, 0, s.every]
    assert host_session.CPU_SESSION.iters != host_session.CPU_SESSION.dynmo_iters  # the dry run tries both lengths


def test_the_profiled_pretrain_gpt_run_is_timed_by_its_own_rounds():
    """The host shape's stage_prediction[mlm-host] times the --dynmo program's iterations
    without ITS rounds' first and last, not the other programs' (shorter rounds)."""
    session = _session()
    runs = gpu_check.Runs()
    runs.get("host-session", lambda: session)
    times, report = rows_mlm._mlm_profiled(gpu_check.Machine(gpus=["H200"]), "host", Path("unused"), runs, 4)
    assert report is session.report and 1 not in times
    assert not session.dynmo_spec.edges() & set(times) and session.spec.edges() - session.dynmo_spec.edges() <= set(times)


def test_a_rounds_median_is_of_its_own_iterations_without_the_wait_and_the_windows():
    spec = bt.BatonSpec("f", "a", 1, 2, 5)              # round 1: 2-6, round 2: 7-11
    times = {1: 9.0, 2: 5.0, 3: 0.1, 4: 0.2, 5: 0.3, 6: 4.0, 7: 5.0, 8: 0.1, 9: 0.2, 10: 0.9, 11: 4.0}
    assert host_session.round_medians(times, spec) == pytest.approx([0.2, 0.2])  # no wait, no sync
    assert host_session.round_medians(times, spec, skip={10}) == pytest.approx([0.2, 0.15])


def test_a_round_with_nothing_left_to_time_is_a_failure_not_a_crash():
    spec = bt.BatonSpec("f", "a", 1, 2, 3)              # round 1: 2-4 (2, 4: its edges)
    with pytest.raises(gpu_check.CheckFailed, match="round 1: no iteration left"):
        host_session.round_medians({i: 0.1 for i in range(1, 8)}, spec, skip={3})


def test_the_on_off_comparison_refuses_a_plugin_wrapper_it_cannot_bypass():
    """Without Megatron-LM's own train_step (`__wrapped__`, kept by enable()'s
    functools.wraps) the plugin would run on every iteration and on/off compare the
    plugin with itself."""
    from gpu_checks import mlm_program
    mtt = SimpleNamespace(train_step=lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="keeps no __wrapped__"):
        mlm_program.wrap_train_step(mtt, bt.BatonClient(bt.BatonSpec("f", "mlm_dynmo", 3, 4, 14, alternate=14)))
    mlm_program.wrap_train_step(mtt, bt.BatonClient(bt.BatonSpec("f", "mlm", 3, 4, 14)))  # no comparison asked
    assert mtt.train_step.__wrapped__ is not None
