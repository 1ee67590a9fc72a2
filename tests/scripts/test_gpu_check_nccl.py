"""scripts/gpu_check_nccl.py --cpu --json: exactly one JSON document on stdout with the
contract scripts/gpu_check.py reads; CUDA rows say "skipped: no CUDA", the rows that run
on CPU (rebuild at PP=1 bf16 + distributed optimizer over gloo, the chunked checksum,
the control plane refusing a 'meta' payload on both ranks) pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_nccl as nccl  # noqa: E402
CPU_ROWS = {"rebuild_distopt_bf16", "wire_checksum_peak", "control_plane_cuda_state", "layer_streams", "grad_norm",
            "grad_reduce"}


@pytest.mark.multiproc
def test_cpu_json_run_is_green_and_keeps_the_contract():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_nccl.py"), "--cpu", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]  # the whole stdout is one document
    assert all(set(r) == {"check", "result", "detail", "seconds"} for r in rows)
    assert all(isinstance(r["seconds"], float) for r in rows)
    by_name = {r["check"]: r for r in rows}
    assert [r["check"] for r in rows] == nccl.row_names()  # what gpu_check.py plans
    assert {n for n, r in by_name.items() if r["result"] == "pass"} == CPU_ROWS
    assert all(r["result"] == "skipped: no CUDA" for n, r in by_name.items() if n not in CPU_ROWS)
    assert {"nccl_destroyed_group", "nccl_cpu_tensor", "nccl_shrink_support", "sampled_addmm_bf16",
            "determinism_bitwise", "sync_free[none]", "sync_free[packed_documents]"} <= by_name.keys()
    assert by_name["rebuild_distopt_bf16"]["detail"].startswith("gloo: rebuild applied")
    assert "refused on both ranks" in by_name["control_plane_cuda_state"]["detail"]
    assert by_name["layer_streams"]["detail"].startswith("cpu: draws keyed, rank streams back")
    assert by_name["grad_norm"]["detail"].startswith("cpu: ") and "order-free" in by_name["grad_norm"]["detail"]
    assert by_name["grad_reduce"]["detail"].startswith("cpu: sync in slices, overlapped and scatter: values back")


_HANGS_AFTER_ONE = ("import json, time\n"  # a fault: a shared child that hangs in its second row
                    "print(json.dumps({'check': 'a', 'result': 'pass', 'detail': 'ok', 'seconds': 0.1}), flush=True)\n"
                    "time.sleep(600)\n")


def test_a_hung_shared_child_fails_its_row_and_names_it_for_the_rows_after():
    proc = subprocess.Popen([sys.executable, "-c", _HANGS_AFTER_ONE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    import time
    rows = nccl._collect(["a", "b", "c"], proc, time.perf_counter(), 3.0)
    assert [(r["check"], r["result"]) for r in rows] == [("a", "pass"), ("b", "FAIL"), ("c", "FAIL")]
    assert rows[1]["detail"] == "no end after 3 s (a hang?)"
    assert rows[2]["detail"] == "not run: its shared process ended in b"
    assert proc.poll() is not None  # killed, with its session


def test_sync_free_counts_real_synchronisations_not_torchs_prototype_warning():
    """torch warns once that sync-debug mode "is a prototype feature" when the mode is set
    (torch/cuda/__init__.py on the H200's torch 2.11): it was counted as one host
    synchronisation in every scenario. Real ones are c10's "called a synchronizing CUDA
    operation"."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", UserWarning)
        warnings.warn("an unrelated warning about synchronizing nothing", UserWarning)
        assert nccl.host_syncs(caught) == []
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
    assert [str(w.message) for w in nccl.host_syncs(caught)] == ["called a synchronizing CUDA operation"] * 2


@pytest.mark.multiproc
def test_only_the_rows_asked_for_run_and_an_unknown_one_is_one_line():
    """`--only` (what gpu_check.py passes for the nccl/ rows its --only picks): those rows
    alone, in one child each as without it; a name that is no row: exit 2, the rows named."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_nccl.py"), "--cpu", *a],  # noqa: E731
                                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    proc = run("--json", "--only", "grad_norm,sync_free[moe]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["check"], r["result"]) for r in rows] == [("grad_norm", "pass"), ("sync_free[moe]", "skipped: no CUDA")]
    bad = run("--only", "grad_norms")
    assert bad.returncode == 2 and "--only: no row grad_norms (rows: nccl_shrink_support," in bad.stderr
