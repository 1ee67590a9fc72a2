"""scripts/gpu_check.sh / gpu_check.py: the verdict logic, and the CPU dry run end to end
(the GPU checks themselves need CUDA: on this machine they must say "skipped: no CUDA")."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)
GPU_CHECKS = {"transformer_engine", "bf16_vs_fp32_speed", "migration_bitexact[fp32]",
              "migration_bitexact[bf16]", "repack_2_to_1", "throughput_vs_megatron_lm",
              *(f"{row}[{shape}]" for row in ("identical_layers", "heavy_layer", "profiling_overhead",
                                              "stage_prediction")
                for shape in ("host", "gpu")), "identical_layers[mlm-host]", "identical_layers[mlm-gpu]",
              "stage_prediction[mlm-host]", "stage_prediction[mlm-gpu]",
              *(f"scenario_cost[{kind}]" for kind in ("gradual_pruning", "layer_freezing",
                                                       "mixture_of_depths", "early_exit", "moe",
                                                       "sparse_attention"))}


def _profile(costs: dict[int, float]) -> dict:
    return {"layers": [{"layer": n, "fwd_s": c / 3, "bwd_s": 2 * c / 3} for n, c in costs.items()],
            "stages": [{"clock": "cuda_events"}]}


def test_heavy_layer_verdict_needs_the_factor_within_tolerance():
    detail = gpu_check.heavy_layer_verdict(_profile({1: 1.0, 2: 1.1, 3: 3.0, 4: 0.9}), 3, 3, 0.25)
    assert detail.startswith("layer 3: 3.000x its neighbours' median (expected 3x +-25%); 4 layers")
    for costs in ({1: 1.0, 2: 1.0, 3: 1.5, 4: 1.0}, {1: 1.0, 2: 1.0, 3: 4.0, 4: 1.0}):
        with pytest.raises(gpu_check.CheckFailed, match="layer 3: "):
            gpu_check.heavy_layer_verdict(_profile(costs), 3, 3, 0.25)
    with pytest.raises(gpu_check.CheckFailed, match="missing from the profile"):
        gpu_check.heavy_layer_verdict(_profile({1: 1.0, 2: 1.0}), 3, 3, 0.25)


def test_parameters_compared_bit_for_bit():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    b = {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-30]), "extra": torch.ones(1)}
    assert gpu_check.compare_params(a, dict(a)) == []
    assert gpu_check.compare_params(a, b) == ["b", "extra"]


def test_table_and_exit_status():
    Row = gpu_check.Row
    rows = [Row("machine", "pass", "1 x H100"), Row("repack_2_to_1", gpu_check.NO_CUDA)]
    assert gpu_check.exit_status(rows) == 0
    assert gpu_check.exit_status(rows + [Row("x", "FAIL", "why")]) == 1
    lines = gpu_check.render(rows).splitlines()
    assert lines[0].split(" | ") == ["check        ", "result          ", "detail"]
    assert lines[3] == "repack_2_to_1 | skipped: no CUDA | "


def test_no_cuda_fails_the_machine_check_unless_dry_run():
    with pytest.raises(gpu_check.CheckFailed, match="--dry-run to check this script on CPU"):
        gpu_check.check_machine(gpu_check.Machine(torch="2.13.0+cpu"), None, None)
    row = gpu_check.check_machine(gpu_check.Machine(cpu_mode=True), None, None)
    assert row.result == gpu_check.NO_CUDA


def test_precision_flag_fails_where_the_launcher_has_no_bf16_and_packages_imports_megatron_core():
    """docs/gpu.md: precision_flag passes when the launcher takes --bf16 (it passed without),
    packages when megatron-core imports (it read the metadata only)."""
    assert gpu_check.check_precision_flag(gpu_check.Machine(bf16=True), None, None).result == "pass"
    with pytest.raises(gpu_check.CheckFailed, match="no --bf16"):
        gpu_check.check_precision_flag(gpu_check.Machine(bf16=False), None, None)
    row = gpu_check.check_packages(gpu_check.Machine(te_problem="no CUDA"), None, None)
    assert row.result == "pass" and " imports; Transformer Engine not usable (no CUDA)" in row.detail


def test_the_json_is_written_even_where_no_row_ran(tmp_path, capsys):
    """On the 2026-11-28 rehearsal every row of `--set issue34` skipped on CPU, no row made
    --out, and the JSON write raised (on a GPU: a budget that skips every group)."""
    import signal
    out, before = tmp_path / "not" / "made", signal.getsignal(signal.SIGTERM)
    assert gpu_check.main(["--cpu", "--only", "machine", "--out", str(out), "--json"]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # main's SIGTERM handling ends with it
    assert json.loads((out / "gpu_check.json").read_text())["rows"][0]["check"] == "machine"
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "gpu_check.sh: error: unknown argument --bogus (see --help)"),
    (["--wheels", "/nonexistent-wheels"], "gpu_check.sh: error: --wheels /nonexistent-wheels: no such directory"),
])
def test_usage_errors_exit_2_with_one_line(argv, message):
    proc = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == message


def _ran_on_cpu(rows: dict, name: str, *figures: str) -> None:
    """The row ran in the dry run and printed its figures (a verdict that found data
    missing prints 'no figures: ...' instead, and fails this)."""
    detail = rows[name]["detail"]
    assert rows[name]["result"] == gpu_check.NO_CUDA and detail.startswith("ran on CPU (not judged): "), detail
    assert "no figures" not in detail and all(f in detail for f in figures), detail


@pytest.mark.multiproc
def test_dry_run_on_cpu_runs_what_it_can_and_skips_the_gpu_checks(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--python", sys.executable, "--", "--json",
                           "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    result = json.loads(proc.stdout)  # exactly one JSON document on stdout
    rows = {r["check"]: r for r in result["rows"] if not r["check"].startswith("nccl")}  # its own test
    # gpu_check.sh said what it did with torch: a CPU build here, a CUDA build kept in the
    # device rehearsal (scripts/device_rehearsal.sh: torch 2.11.0+cu130 without a GPU)
    assert ("dry run:" in proc.stderr or "keeping torch" in proc.stderr) and result["machine"]["cpu_mode"]
    # the plan of the machines the check is for, printed before the rows (docs/gpu.md "Budget")
    assert "launch plan (1 GPU(s), DYNMO_MEGATRON_LM set" in proc.stderr
    assert result["plan"]["total_s"] <= result["plan"]["budget_s"] == 480
    expected = {"machine", "packages", "precision_flag", "profile_heavy_layer"} | GPU_CHECKS
    if not result["machine"]["bf16"]:
        expected.discard("migration_bitexact[bf16]")
    assert set(rows) == expected
    assert all(rows[c]["result"] == gpu_check.NO_CUDA for c in GPU_CHECKS & set(rows))
    assert rows["machine"]["result"] == gpu_check.NO_CUDA
    assert rows["packages"]["result"] == rows["precision_flag"]["result"] == "pass"
    if os.environ.get("DYNMO_MEGATRON_LM"):  # the interleaved session ran, tiny models on CPU
        detail = rows["throughput_vs_megatron_lm"]["detail"]
        assert detail.startswith("the interleaved session ran (not judged on CPU)") or \
            "CPU harness needs" in detail, detail
        if "CPU harness needs" not in detail:
            assert "15 turns in 4 rounds + warm-up, none overlapping" in detail, detail
            assert "plugin on/off in one process" in detail, detail
            # the --dynmo program's plugin ran in the warm-up, on every other iteration (the
            # even ones in odd rounds, the odd ones in even rounds) and in its windows (every
            # 8th); Megatron-LM's own train_step ran the others. Its rounds (8) are longer than
            # the other programs' (6): 34 iterations, theirs 26
            report = json.loads((tmp_path / "session" / "mlm_dynmo" / "dynmo" / "report.json").read_text())
            assert [i["iteration"] for i in report["iterations"]] == [
                1, 2, 4, 6, 8, 10, 11, 13, 15, 16, 17, 20, 22, 24, 26, 27, 29, 31, 32, 33]
            launcher = json.loads((tmp_path / "session" / "launcher" / "report.json").read_text())
            assert len(launcher["iterations"]) == 26, [i["iteration"] for i in launcher["iterations"]]
            _ran_on_cpu(rows, "identical_layers[mlm-host]", "inside pretrain_gpt.py: max/min ")
            _ran_on_cpu(rows, "stage_prediction[mlm-host]", "inside pretrain_gpt.py: predicted ", "vs measured")
    # issue 34's launcher rows: the host shape's run at the CPU size, each verdict computed
    # from the real report (not judged); the GPU shape's rows are not run
    _ran_on_cpu(rows, "identical_layers[host]", "launcher: max/min ", "span constant")
    _ran_on_cpu(rows, "heavy_layer[host]", "layer 3 ", "layer 5 ", "fit cost = ")
    _ran_on_cpu(rows, "profiling_overhead[host]", "profiled ", "unprofiled ", "closing a window")
    _ran_on_cpu(rows, "stage_prediction[host]", "launcher: predicted ", "vs measured")
    assert all(rows[f"{r}[gpu]"]["detail"] == "" for r in ("identical_layers", "heavy_layer", "stage_prediction"))
    heavy = rows["profile_heavy_layer"]  # a real PP=1 run with the 3x layer (CPU thread time)
    assert heavy["result"] in ("pass", "FAIL") and "layer 3: " in heavy["detail"], heavy
    failed = [r for r in result["rows"] if r["result"] == "FAIL"]
    assert result["ok"] == (not failed) and proc.returncode == (1 if failed else 0), proc.stderr[-2000:]
