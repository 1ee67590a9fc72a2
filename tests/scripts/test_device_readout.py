"""scripts/device_readout.py: what one device call brought back, read in one place (the
session that gets a GPU has one call and little time to read it). The OUT here is laid
out as device_check.sh lays it out, its archive packed by the real gpu_check_pack.py."""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


STDERR = """[gpu_check_worker] run shape_gpu
dynmo: stage 0: GPU kernels were attributed to forward spans only (no backward kernels)
kernels: set TEARDOWN_CUPTI=1 (CUDA 13.0)
dynmo: kernel records for 97.50% of the window's kernel launches: CUPTI dropped the others
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    step()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
after the error
"""


def _common():
    sys.path.insert(0, str(SCRIPTS))
    from gpu_checks import common
    return common


def _out(tmp_path: Path) -> Path:
    runs, out = tmp_path / "work" / "gpu_check", tmp_path / "out"
    (runs / "shape_gpu" / "ckpt").mkdir(parents=True)
    (runs / "shape_gpu" / "stderr.log").write_text(STDERR)
    (runs / "shape_gpu" / "ckpt" / "model.pt").write_bytes(b"0" * (2 << 20))
    out.mkdir()
    _module("gpu_check_pack").pack(out / "logs.tar.gz", [runs])
    common = _common()  # the rows as gpu_check writes them
    rows = [common.Row("machine", "pass", "NVIDIA H200", 0.1),
            common.Row("heavy_layer[gpu]", "FAIL", "layer 3 2.7x (expected 3x)", 40.0),
            common.Row("repack_2_to_1", "skipped: needs 2 GPUs", "", 0.0)]
    (out / "gpu_check.json").write_text(json.dumps({"ok": False, "rows": [asdict(r) for r in rows]}))
    (out / "device_check.txt").write_text("gpu_check.sh: exit 1, 300 s (budget 300 s)\ntotal: 420 s of 480 s\n")
    (out / "megatron_lm.txt").write_text("[megatron_lm_gpu_check.sh] 1/3 pretrain_gpt.py, 20 iterations\n"
                                         "  iteration 20/20 | elapsed time per iteration (ms): 212.0\n"
                                         "profile events at [5, 10] (want [5, 10]): PASS\n"
                                         "[megatron_lm_gpu_check.sh] the run failed (exit 1): moe.log\n")
    return out


def test_the_readout_puts_failed_rows_first_and_finds_the_lines_to_read(tmp_path, capsys):
    readout = _module("device_readout")
    out = _out(tmp_path)
    assert readout.main([str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["check"] for r in data["rows"]] == ["heavy_layer[gpu]", "repack_2_to_1", "machine"]
    assert data["archive"]["manifest"] == {"kept": 1, "excluded": 1}  # the log; the checkpoint
    signals = data["archive"]["signals"]
    assert [(s["file"], s["line"]) for s in signals["forward_only"]] == [("gpu_check/shape_gpu/stderr.log", 2)]
    assert [s["line"] for s in signals["teardown_cupti"]] == [3]
    assert [s["line"] for s in signals["kernel_records_lost"]] == [4]
    assert [s["text"] for s in signals["errors"]] == [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert data["megatron_lm"] == ["[megatron_lm_gpu_check.sh] 1/3 pretrain_gpt.py, 20 iterations",
                                   "profile events at [5, 10] (want [5, 10]): PASS",
                                   "[megatron_lm_gpu_check.sh] the run failed (exit 1): moe.log"]
    assert readout.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "== rows (gpu_check.json): 1 pass, 1 FAIL, 1 skipped" in text
    assert "-- errors: 1\n   gpu_check/shape_gpu/stderr.log:8  torch.OutOfMemoryError" in text


def test_a_call_cut_before_its_summary_still_reads_and_an_empty_folder_is_exit_2(tmp_path, capsys):
    readout = _module("device_readout")
    out = _out(tmp_path)
    (out / "device_check.txt").unlink()
    (out / "logs.tar.gz").unlink()
    assert readout.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "device_check.txt: missing" in text and "== logs.tar.gz: missing" in text
    with pytest.raises(SystemExit):
        readout.main([])
    assert readout.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"device_readout.py: error: {tmp_path / 'nothing'} holds none of device_check.sh's files")
