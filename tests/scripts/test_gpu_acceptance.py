"""scripts/gpu_check.py as the product's GPU acceptance (issue 24): the verdicts of the new
rows on recorded profiles, the per-scenario cost file, the nccl rows it appends, and the
determinism settings gpu_check.sh forces. The GPU runs themselves need CUDA."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from test_gpu_check import ROOT, SCRIPT, gpu_check


def _profile(costs: dict[int, float]) -> dict:
    return {"layers": [{"layer": n, "fwd_s": c / 3, "bwd_s": 2 * c / 3} for n, c in costs.items()],
            "stages": [{"clock": "cuda_event"}]}


def test_identical_layers_verdict_is_max_over_min_of_the_others():
    ratio, detail = gpu_check.identical_verdict(_profile({1: 1.0, 2: 1.08, 3: 3.0, 4: 1.02}), exclude=(3,))
    assert ratio == pytest.approx(1.08) and "over 3 layers" in detail
    ratio, _ = gpu_check.identical_verdict(_profile({1: 2.2e-3, 2: 1.0e-3, 3: 1.3e-3}))
    assert ratio == pytest.approx(2.2) and ratio > gpu_check.IDENTICAL_MAX  # the H200 defect
    with pytest.raises(gpu_check.CheckFailed, match="too few"):
        gpu_check.identical_verdict(_profile({1: 1.0, 3: 3.0}), exclude=(3,))


def test_heavy_layer_acceptance_is_ten_percent():
    assert gpu_check.heavy_layer_verdict(_profile({1: 1.0, 2: 2.8, 3: 1.0}), 2, 3, gpu_check.HEAVY_ACCEPT)
    with pytest.raises(gpu_check.CheckFailed):  # what the H200 measured: inside 25%, not 10%
        gpu_check.heavy_layer_verdict(_profile({1: 1.0, 2: 2.638, 3: 1.0}), 2, 3, gpu_check.HEAVY_ACCEPT)


def _work(c: float, w: float, heavy: dict, n: int = 6) -> dict:
    """Layer costs c + k*w: k = the heavy layers' factors, 1 for the others."""
    return {i: c + heavy.get(i, 1) * w for i in range(1, n + 1)}


def test_heavy_layers_at_two_factors_check_the_slope_not_just_a_ratio():
    """Cost = c + k*w. With no constant (c = 0) both factors read true and the intercept is
    0. The H200's kind of constant (c ~ 1.1 ms beside w ~ 4.6 ms: 3x read 2.63-2.73x)
    fails; so does a layer booked at the wrong factor."""
    heavy, accept = gpu_check.HEAVY_LAYERS, gpu_check.HEAVY_ACCEPT
    assert heavy == {3: 3, 5: 2}
    detail = gpu_check.heavy_slope_verdict(_profile(_work(0.0, 4.6e-3, heavy)), heavy, accept)
    assert "layer 3 3.000x (expected 3x), layer 5 2.000x (expected 2x)" in detail
    assert "fit cost = +0.000 + 1.000 x work" in detail
    with pytest.raises(gpu_check.CheckFailed, match=r"layer 3 2\.6\d\dx .* fit cost = \+0\.19"):
        gpu_check.heavy_slope_verdict(_profile(_work(1.1e-3, 4.6e-3, heavy)), heavy, accept)
    # each ratio inside 10% but the intercept outside: c = 0.12 of a neighbour
    with pytest.raises(gpu_check.CheckFailed, match="intercept"):
        gpu_check.heavy_slope_verdict(_profile(_work(0.6e-3, 4.4e-3, heavy)), heavy, accept)
    wrong = _work(0.0, 1e-3, heavy) | {5: 3e-3}  # layer 5 measured 3x for 2x of work
    with pytest.raises(gpu_check.CheckFailed, match="layer 5 3.000x"):
        gpu_check.heavy_slope_verdict(_profile(wrong), heavy, accept)
    # neighbours that cost nothing (a clock that read zero): a failure with a reason, not
    # a ZeroDivisionError with no figures
    with pytest.raises(gpu_check.CheckFailed, match="neighbours' median cost is 0"):
        gpu_check.heavy_slope_verdict(_profile(_work(0.0, 0.0, heavy)), heavy, accept)


def test_a_row_on_a_gpu_fails_where_no_kernel_time_was_attributed():
    """Review 2026-11-29: with no kernel attributed the costs fall back to the host's launch
    time, which also reads 3x for a 3x layer (its launches are 3x): the GPU rows passed
    with the GPU's busy time never measured. Each layer needs kernel time, and the
    GPU-bound shape its costs from the kernels; the dry run (no GPU) is not held to it."""
    def profile(gpu_s: float, source: str) -> dict:
        return {"layers": [{"layer": n, "fwd_s": 1.0, "bwd_s": 2.0, "gpu_s": gpu_s} for n in (1, 2)],
                "stages": [{"cost_source": source}]}
    gpu, cpu = gpu_check.Machine(gpus=["H200"]), gpu_check.Machine(cpu_mode=True)
    check = gpu_check.with_kernel_clock
    assert check(gpu, "gpu", [profile(3e-3, "gpu_kernels")], True, "d") == (True, "d")
    assert check(gpu, "host", [profile(3e-3, "host_cpu")], True, "d") == (True, "d")
    passed, detail = check(gpu, "host", [profile(3e-3, "host_cpu"), profile(0.0, "host_cpu")], True, "d")
    assert not passed and "no GPU kernel time attributed to layers [1, 2]" in detail
    passed, detail = check(gpu, "gpu", [profile(3e-3, "host_cpu")], True, "d")
    assert not passed and "costs from host_cpu, not the GPU kernels, at the GPU-bound shape" in detail
    assert check(cpu, "host", [profile(0.0, "span")], True, "d") == (True, "d")
    assert check(gpu, "gpu", [profile(3e-3, "gpu_kernels")], False, "d") == (False, "d")
    # CUPTI dropped kernel records (pytorch#192021): every layer still has some kernel time
    lossy = profile(3e-3, "gpu_kernels")
    lossy["stages"][0]["kernel_coverage"] = 0.95
    passed, detail = check(gpu, "gpu", [profile(3e-3, "gpu_kernels"), lossy], True, "d")
    assert not passed and "kernel records for 95.0% of the kernel launches (under 98%)" in detail
    lossy["stages"][0]["kernel_coverage"] = 0.99
    assert check(gpu, "gpu", [lossy], True, "d") == (True, "d")


def _stage_report(predicted: list[float], times: dict[int, float], windows: list[list[int]]) -> dict:
    return {"iterations": [{"iteration": i, "time_s": t} for i, t in times.items()],
            "events": [{"kind": "profile", "iteration": w[-1], "window": w,
                        "profile": {"layers": [], "stages": [{"predicted_s": p}]}} for w, p in zip(windows, predicted)]}


def test_stage_prediction_is_held_to_iterations_outside_windows():
    times = {i: 0.100 for i in range(1, 13)} | {1: 2.0, 4: 0.5, 8: 0.5, 12: 0.5}  # warm-up, windows
    worst, detail = gpu_check.prediction_verdict(_stage_report([0.104, 0.095], times, [[4, 4], [8, 8]]),
                                                 times)
    assert worst == pytest.approx(-0.05) and "measured 100.0 ms outside windows (median of 7)" in detail
    worst, _ = gpu_check.prediction_verdict(_stage_report([0.085], times, [[4, 4]]), times)
    assert worst == pytest.approx(-0.15) and abs(worst) > gpu_check.PREDICTION_ACCEPT
    with pytest.raises(gpu_check.CheckFailed, match="predicted stage times"):
        gpu_check.prediction_verdict(_stage_report([0.0], times, [[4, 4]]), times)
    # what the prediction holds and the step as the controller timed it are printed beside
    report = _stage_report([0.104], times, [[4, 4]])
    report["events"][0]["profile"]["stages"][0] |= {"rest_s": 0.012, "step_s": 0.003, "measured_s": 0.093}
    _, detail = gpu_check.prediction_verdict(report, times)
    assert detail.endswith("rest of the step 12.0 ms (host) 0.0 ms (GPU), optimizer step 3.0 ms, the step as timed "
                           "around train_step 93.0 ms"), detail


def test_throughput_overhead_is_judged_only_where_the_pairs_resolve_three_percent():
    """The plugin's on/off is judged from the interval over every pair (gpu_checks/paired.py),
    the rounds' medians printed beside: an interval wholly over 1.03 fails, wholly at or
    under passes, across it is "not judged", whatever the rounds alone would say."""
    def verdict(pairs, plugin=(1.0,) * 4, ratio=(0.95,) * 4):
        return gpu_check.throughput_verdict(gpu_check.SessionRatios([0.20, 0.21, 0.20, 0.20], list(ratio), list(plugin),
                                                                    [1.10, 0.92, 1.05, 1.0], 1.01, pairs, 1.004),
                                            "host", 20)
    tight = [1.0 + 0.004 * (k % 5 - 2) for k in range(28)]  # 0.992-1.008
    ok, detail = verdict(tight, plugin=(1.01, 1.02, 1.00, 1.01))
    assert ok and "4 interleaved rounds" in detail and "over 28 pairs), at or under 1.03" in detail
    assert "plugin on/off in one process 1.000x (95% interval 0.9" in detail
    assert "the pairs summed 1.004x; by round 1.010 1.020 1.000 1.010 (rounds 1.000-1.020)" in detail
    assert "the --dynmo process's steps without the plugin / the plain process's 1.025x (rounds 0.920-1.100)" in detail
    assert "over the plain process's same) 1.010x (printed, no verdict)" in detail
    ok, detail = verdict([1.05 * x for x in tight], plugin=(0.97, 1.08, 1.01, 1.00))
    assert not ok and "), over 1.03" in detail  # rounds that straddled (once "not judged"): the pairs resolve it
    ok, detail = verdict([1.19 * x for x in tight])
    assert not ok and "1.190x" in detail
    wide = [1.04 * math.exp(0.1 * (k - 13.5) / 13.5) for k in range(28)]  # +-10% around 1.04
    ok, detail = verdict(wide, plugin=(1.04, 1.05, 1.04, 1.05))
    assert ok and "1.040x" in detail and "not judged: the interval spans 1.03" in detail  # its estimate over 1.03,
    # every round over: neither fails alone
    ok, _ = verdict(tight, ratio=(1.05,) * 4)
    assert not ok  # launcher slower than Megatron-LM


def test_a_shared_run_the_budget_stopped_is_skipped_for_every_row_that_shares_it():
    """Runs.get re-raised every stored failure as a plain CheckFailed: a run the budget
    stopped read FAIL in each row sharing it, not "skipped: budget"."""
    runs = gpu_check.Runs()

    def stopped():
        raise gpu_check.BudgetExceeded("stopped after 3 s: the budget (--budget-s) was spent")
    rows = [gpu_check._guard(name, lambda: runs.get("shape-host", stopped)) for name in ("a", "b")]
    assert [r.result for r in rows] == [gpu_check.SKIPPED_BUDGET] * 2
    assert rows[1].detail.startswith("(shared run shape-host) stopped after 3 s")
    failed = gpu_check._guard("c", lambda: runs.get("other", lambda: 1 / 0))
    assert failed.result == "FAIL" and "ZeroDivisionError" in failed.detail


def _report(times: dict[int, float], windows: list[list[int]]) -> dict:
    return {"iterations": [{"iteration": i, "time_s": t} for i, t in times.items()],
            "events": [{"kind": "profile", "iteration": w[-1], "window": w, "profile": _profile({1: 1.0})}
                       for w in windows]}


def test_profiling_overhead_compares_window_iterations_with_the_others_after_warmup():
    times = {1: 9.0, 2: 9.0, 3: 1.0, 4: 1.25, 5: 1.0, 6: 1.0, 7: 1.0, 8: 1.25}
    ratio, detail = gpu_check.overhead_verdict(_report(times, [[4, 4], [8, 8]]))
    assert ratio == pytest.approx(1.25) and "1.250x" in detail
    # in order, the one before the first window beside those after it
    assert detail.endswith("unprofiled ms by iteration 3:1000.0 5:1000.0 6:1000.0 7:1000.0")
    report = _report(times, [[4, 4], [8, 8]])  # closing a window: the plugin's own time, apart
    for it in report["iterations"]:
        it["dynmo_s"] = 0.5 if it["iteration"] in (4, 8) else 0.001
        it["time_s"] += it["dynmo_s"]
    ratio, detail = gpu_check.overhead_verdict(report)
    assert ratio == pytest.approx(1.25 / 1.001) and "closing a window 500.0 ms once" in detail
    with pytest.raises(gpu_check.CheckFailed, match="profiled and unprofiled"):
        gpu_check.overhead_verdict(_report(times, []))


def test_timed_profiles_skip_estimated_and_cancelled_ones():
    report = _report({1: 1.0}, [[4, 4], [8, 8]])
    report["events"][0]["profile_source"] = "estimated"
    report["events"].append({"kind": "profile", "iteration": 9, "cancelled": "moved", "profile": _profile({})})
    assert [e["iteration"] for e in gpu_check.timed_profiles(report)] == [8]


def test_scenario_ratio_against_dense_layers_or_the_same_layers_before():
    by_name = {sc.kind: sc for sc in gpu_check.SCENARIOS}
    assert set(by_name) == {"gradual_pruning", "layer_freezing", "mixture_of_depths", "early_exit",
                            "moe", "sparse_attention"}
    before, after = _profile({n: 1.0 for n in range(1, 9)}), _profile({**{n: 0.2 for n in (1, 2, 3, 4)},
                                                                       **{n: 1.0 for n in (5, 6, 7, 8)}})
    ratio, figures = gpu_check.scenario_ratio(by_name["mixture_of_depths"], [before, after], 8)
    assert ratio == pytest.approx(0.2) and figures["reference_cost_s"] == pytest.approx(1.0)
    ratio, _ = gpu_check.scenario_ratio(by_name["gradual_pruning"], [before, after], 8)
    assert ratio == pytest.approx(0.6)  # median of all 8 layers after (0.2 x4, 1.0 x4) over before


def _costs() -> dict:
    """What check_scenario records for three scenarios (two shapes; early exit repeats
    --vocab-size as its model flags do)."""
    by_name = {sc.kind: sc for sc in gpu_check.SCENARIOS}
    def figures(kind, ratio, ref_s, **more):
        sc = by_name[kind]
        return {"ratio": ratio, "threshold": sc.threshold, "passed": True, "model": sc.model + sc.extra,
                "affected_cost_s": ratio * ref_s, "reference_cost_s": ref_s, **more}
    return {"mixture_of_depths": figures("mixture_of_depths", 0.2, 0.006),
            "gradual_pruning": figures("gradual_pruning", 0.7, 0.0062),
            "early_exit": figures("early_exit", 0.5, 0.005, exited_fraction=0.8),
            "moe": figures("moe", 0.7, 0.01)}


def test_scenario_costs_file_format(tmp_path):
    machine = gpu_check.Machine(gpus=["NVIDIA H100 80GB HBM3"], torch="2.13.0", bf16=True)
    costs = _costs()
    path = gpu_check.write_scenario_costs(machine, costs, tmp_path)
    data = json.loads(path.read_text())
    assert data["format"] == "dynmo-scenario-costs/1" and data["precision"] == "bf16"
    assert data["device"] == "NVIDIA H100 80GB HBM3" and data["scenarios"] == costs
    assert gpu_check.write_scenario_costs(machine, {}, tmp_path / "none") is None


def test_scenario_costs_feed_the_simulators_profile_builder(tmp_path):
    """The rows written beside the figures build a hardware profile as they are (one home:
    dynmo_plugin.sim.gpu_curves): one dense base per (hidden, sequence, micro-batch), the
    mean of the passed rows' reference layers (the head is priced by FLOPs: early exit's
    run has a 16-token vocabulary), the knob each scheme was measured at, MoE left out; and
    the named model the simulator loads (`--hardware h200-gpu`) from the same rows."""
    from dynmo_plugin.sim.profile_builder import build_profile, load_rows
    machine = gpu_check.Machine(gpus=["NVIDIA H200"], torch="2.13.0", bf16=True)
    path = gpu_check.write_scenario_costs(machine, _costs(), tmp_path)
    rows = load_rows(path)
    dense = [r for r in rows if r["scenario"] == "dense"]
    # two dense bases: the rows' shared shape (mb2) and MoD's own (mb4: rows_scenarios.py)
    assert [sorted(r["shape"]) for r in dense] == [["hidden", "micro_batch", "seq"]] * 2
    model = json.loads(path.read_text())["gpu_cost_model"]
    assert (model["name"], model["gpu"], model["status"]) == ("h200-gpu", "NVIDIA H200", "measured")
    assert model["measured_scenarios"] == ["early_exit", "gradual_pruning", "mixture_of_depths"]
    by = {r["scenario"]: r for r in rows if r["scenario"] != "dense"}
    assert set(by) == {"mixture_of_depths", "gradual_pruning", "early_exit"}
    assert by["mixture_of_depths"]["knob_value"] == 0.125
    assert by["early_exit"]["knob_value"] == pytest.approx(0.2)
    assert by["gradual_pruning"]["granularity"] == "structured"
    assert by["gradual_pruning"]["knob_value"] == pytest.approx(0.33)
    profile = build_profile(rows, "h200", "test")
    assert profile  # the builder accepted every row


def test_megatron_lm_iteration_times_after_warmup():
    log = "\n".join(f" [..] iteration {i}/20 | elapsed time per iteration (ms): {100 + i:.1f} | lr"
                    for i in range(1, 6))
    assert gpu_check.mlm_iteration_ms(log) == [104.0, 105.0]
    assert gpu_check.mlm_iteration_s(log)[5] == pytest.approx(0.105)
    real = " [2026-11-27 10:00:01] iteration        4/      20 | consumed samples: 64 | elapsed time per iteration (ms): 250.5 | lr"
    assert gpu_check.mlm_iteration_s("\n".join([real.replace("  4/", f"  {i}/") for i in (1, 2, 3)] + [real]))[4] == 0.2505
    with pytest.raises(gpu_check.CheckFailed, match="logged 2"):
        gpu_check.mlm_iteration_ms(log.splitlines()[0] + "\n" + log.splitlines()[1])


def test_nccl_rows_are_appended_from_the_helper_script(tmp_path, monkeypatch):
    script = tmp_path / "gpu_check_nccl.py"  # test data: what the real script prints
    script.write_text("import json, sys\n"
                      "assert sys.argv[1:3] == ['--cpu', '--json'] and sys.argv[3] == '--deadline-s', sys.argv\n"
                      "print(json.dumps({'rows': [{'check': 'destroyed_group', 'result': 'skipped: no CUDA',"
                      " 'detail': '', 'seconds': 0.1}]}))\n")
    monkeypatch.setattr(gpu_check, "NCCL_SCRIPT", script)
    (row,) = gpu_check.nccl_rows(cpu_mode=True)
    assert (row.check, row.result, row.seconds) == ("nccl/destroyed_group", "skipped: no CUDA", 0.1)
    script.write_text("print('not json')\n")
    (row,) = gpu_check.nccl_rows(cpu_mode=True)
    assert row.check == "nccl" and row.result == "FAIL" and "no JSON rows" in row.detail
    monkeypatch.setattr(gpu_check, "NCCL_SCRIPT", tmp_path / "absent.py")
    assert gpu_check.nccl_rows(cpu_mode=True) == []


def test_every_row_is_planned_and_none_runs_on_cpu_but_the_cheap_ones(tmp_path):
    machine = gpu_check.Machine(cpu_mode=True, bf16=True)
    names = [n for n, _ in gpu_check.plan_checks(machine, gpu_check.CPU_SIZES, tmp_path)]
    assert len(names) == len(set(names))
    skipped = [gpu_check._guard(n, fn) for n, fn in gpu_check.plan_checks(machine, gpu_check.CPU_SIZES, tmp_path)
               if n.startswith(("identical", "heavy_layer", "profiling", "throughput", "scenario"))]
    assert len(skipped) == 6 + 2 + 1 + 6
    assert all(r.result == gpu_check.NO_CUDA for r in skipped)


def test_table_prints_each_rows_seconds():
    rows = [gpu_check.Row("machine", "pass", "1 x H100", 0.1), gpu_check.Row("heavy_layer[host]", "pass", "ok", 42.4)]
    lines = gpu_check.render(rows).splitlines()
    assert lines[2].endswith("| 1 x H100") and lines[3].endswith("| ok [42 s]")


def test_determinism_settings_go_to_the_bit_exact_rows_only():
    """Issue 34: every timing row of the H200 run ran under deterministic kernels. Now the
    timed launches (worker, pretrain_gpt.py) have them removed even when the caller's
    environment sets them; the bit-exact rows' launches get them."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", sys.executable, "--",
                           "--json", "--only", "machine"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    result = json.loads(proc.stdout)
    assert result["env"] == {"bit_exact_rows": {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                                                "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
                             "timing_rows": {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": None,
                                             "CUBLAS_WORKSPACE_CONFIG": None}}
    assert [r["check"] for r in result["rows"]] == ["machine"] and proc.returncode == 0
    timed, exact = gpu_check.worker_env(), gpu_check.worker_env(deterministic=True)
    assert not set(gpu_check.DETERMINISM_ENV) & set(timed)
    assert all(exact[k] == v for k, v in gpu_check.DETERMINISM_ENV.items())


def test_simulator_cost_rows_come_only_from_rows_that_passed():
    costs = _costs()
    costs["mixture_of_depths"]["passed"] = False  # e.g. the H200's 0.801x against 0.3x
    rows = gpu_check.builder_rows(costs)
    assert "mixture_of_depths" not in {r["scenario"] for r in rows}
    assert {r["scenario"] for r in rows} == {"dense", "gradual_pruning", "early_exit"}
