"""The roofline estimate (dynmo_plugin/profiling/roofline.py) and scripts/roofline.py.

Pure checks on hand-made op records: the estimate grows with FLOPs and bytes, host time
counts kernels, a bf16 matmul with a dimension not a multiple of 8 is charged the slow
rate. Then one run of `scripts/roofline.py --calibrate --json` (real Megatron-Core
layers traced on the fake device, in its own process: the CPU compatibility layer must
not patch pytest's torch): every calibration row is reproduced within the bound the
module states, and the traced plain layer's FLOPs are the analytic count."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_plugin.profiling import roofline as rl
from dynmo_plugin.profiling.op_trace import OpRecord

ROOT = Path(__file__).resolve().parents[2]
C = rl.H200_CONSTANTS


def mm(m: int, k: int, n: int, dtype_bytes: int = 2) -> OpRecord:
    return OpRecord("aten.mm", ((m, k), (k, n)), ((m, n),), "bfloat16", 2 * m * k * n,
                    dtype_bytes * (m * k + k * n + m * n), True, False)


def elementwise(nbytes: int) -> OpRecord:
    return OpRecord("aten.add", ((nbytes // 6,), (nbytes // 6,)), ((nbytes // 6,),), "bfloat16", 0,
                    nbytes, True, False)


def view() -> OpRecord:
    return OpRecord("aten.view", ((8, 8),), ((64,),), "bfloat16", 0, 0, False, False)


def test_gpu_time_is_monotone_in_flops_and_bytes():
    sizes = [256, 512, 1024, 2048, 4096, 8192]
    gemms = [rl.estimate([mm(s, 4096, 4096)]).gpu_s for s in sizes]
    assert gemms == sorted(gemms) and len(set(gemms)) == len(gemms)
    copies = [rl.estimate([elementwise(b)]).gpu_s for b in (10**6, 10**7, 10**8, 10**9)]
    assert copies == sorted(copies) and len(set(copies)) == len(copies)
    # a large GEMM is compute-bound: twice the FLOPs, close to twice the time
    assert rl.estimate([mm(8192, 8192, 8192)]).gpu_s / rl.estimate([mm(4096, 8192, 8192)]).gpu_s > 1.95


def test_host_time_counts_kernels_and_views_are_free():
    ops = [mm(1024, 1024, 1024), elementwise(10**6), view(), view()]
    est = rl.estimate(ops)
    assert est.kernels == 2
    assert est.host_s == pytest.approx(2 * C.host_per_pass_s + 2 * C.host_per_kernel_s)
    more = rl.estimate(ops + [elementwise(10**6)] * 5)
    assert more.host_s - est.host_s == pytest.approx(5 * C.host_per_kernel_s)
    assert est.host_s - rl.estimate(ops, passes=1).host_s == pytest.approx(C.host_per_pass_s)
    assert rl.estimate([view()] * 100).gpu_s == 0.0


def test_a_misaligned_bf16_matmul_is_charged_the_slow_rate():
    aligned, odd, even = mm(4096, 2048, 2688), mm(4096, 2048, 2703), mm(4096, 2048, 2730)
    assert rl.alignment_factor(aligned, C) == 1.0
    assert rl.alignment_factor(odd, C) == C.misaligned_odd < C.misaligned_even < 1.0
    assert rl.alignment_factor(even, C) == C.misaligned_even
    t = {name: rl.estimate([op]) for name, op in (("aligned", aligned), ("odd", odd), ("even", even))}
    assert t["odd"].misaligned == t["even"].misaligned == 1 and t["aligned"].misaligned == 0
    # the same GEMM's time (past its per-kernel floor) at the slow rate: FLOPs / factor
    work = {k: e.gpu_s - C.kernel_floor_s for k, e in t.items()}
    assert work["odd"] / work["aligned"] == pytest.approx(2703 / 2688 / C.misaligned_odd)
    assert work["even"] / work["aligned"] == pytest.approx(2730 / 2688 / C.misaligned_even)


def test_causal_fused_attention_is_charged_half_its_counted_flops():
    full = OpRecord("aten._scaled_dot_product_flash_attention", ((1, 8, 8192, 128),) * 3,
                    ((1, 8, 8192, 128),), "bfloat16", 275 * 10**9, 4 * 2 * 8 * 8192 * 128, True, False)
    causal = dataclasses.replace(full, causal=True)
    a, b = rl.estimate([full]).gpu_s, rl.estimate([causal]).gpu_s
    floor = C.attention_floor_s + C.kernel_floor_s
    assert (b - floor) == pytest.approx((a - floor) / 2)


def test_constants_are_validated():
    with pytest.raises(ValueError, match="matmul_efficiency"):
        dataclasses.replace(C, matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="host_per_kernel_s"):
        dataclasses.replace(C, host_per_kernel_s=-1.0)


@pytest.fixture(scope="module")
def calibration():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "roofline.py"), "--calibrate", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # the whole stdout is one document


@pytest.mark.multiproc
def test_calibration_rows_are_reproduced_within_the_stated_error(calibration):
    """Rows of stable code (Megatron's own layer, pure torch probes) against the pure
    layers an H200 measured (kernel busy time, host enqueue time); the scheme layers'
    rows hold for the code that was measured and move when that code changes."""
    rows = {r["row"]: r for r in calibration["calibration"]}
    assert set(rows) == {row.name for row in rl.CALIBRATION}
    plain = {name: r["error"] for name, r in rows.items() if r["code"] == "plain"}
    assert len(plain) == 25 and None not in plain.values(), plain
    assert max(map(abs, plain.values())) <= rl.CALIBRATION_MAX_ERROR, plain
    # the Megatron layers' GPU time (what a scheme's GPU ratio rests on) is much closer,
    # unfused and SDPA attention, h1024 to h8192
    gpu = {name: r["error"] for name, r in rows.items() if r["code"] == "plain" and r["kind"] == "gpu"}
    assert len(gpu) == 9 and max(map(abs, gpu.values())) <= rl.CALIBRATION_GPU_MAX_ERROR, gpu
    host = rows["lsh1 h1024 s8192 mb1 host"]
    assert host["host_ms"] > host["gpu_ms"]          # the shape is host-bound, as measured
    big = rows["plain h4096 s2048 mb1 gpu"]
    assert big["gpu_ms"] > big["host_ms"]            # and this one GPU-bound


def test_every_measured_layer_has_a_gpu_and_a_host_row():
    layers = {row.trace for row in rl.CALIBRATION if row.kind in ("gpu", "host")}
    for layer in layers:
        assert rl.measured(layer, "gpu") > 0 and rl.measured(layer, "host") > 0
    assert rl.measured("plain h4096 s2048 mb1", "gpu") == pytest.approx(7.279e-3)
    assert {row.kind for row in rl.CALIBRATION} == {"gpu", "host", "probe"}
    with pytest.raises(KeyError, match="no gpu calibration row"):
        rl.measured("plain h1 s1 mb1")


@pytest.mark.multiproc
def test_traced_plain_layer_flops_are_the_analytic_count(calibration):
    """fwd = 2*T*(4h^2 + 2*h*ffn) for the linears + 4*b*s^2*h for QK^T and PV (unfused,
    the whole square); backward twice that."""
    rows = {r["row"]: r for r in calibration["calibration"]}
    for name, (h, s, b) in {"plain h4096 s2048 mb1 gpu": (4096, 2048, 1),
                            "plain h8192 s4096 mb1 gpu": (8192, 4096, 1)}.items():
        t = s * b
        forward = 2 * t * (4 * h * h + 2 * h * 4 * h) + 4 * b * s * s * h
        assert rows[name]["gflop"] * 1e9 == pytest.approx(3 * forward, rel=1e-12), name
    frozen = rows["frozen h4096 s2048 mb1 gpu"]["gflop"] * 1e9
    assert frozen == pytest.approx(2 * 2048 * 12 * 4096**2 + 4 * 2048**2 * 4096, rel=1e-12)


def test_a_matrix_vector_product_is_not_misaligned():
    assert rl.alignment_factor(mm(4096, 2048, 1), C) == 1.0      # a router's one logit
    assert rl.alignment_factor(mm(4096, 2048, 3), C) == C.misaligned_odd


@pytest.mark.multiproc
def test_both_fallback_traces_reproduce_the_fake_trace_of_a_plain_layer(calibration):
    """Layers the fake device cannot trace (host reads, value-sized ops) are traced for
    real at short sequences and extrapolated, or at a narrow hidden size and widened: on
    a plain layer, which all three can trace, each gives the same FLOPs, bytes, kernels
    and misaligned matmuls as the fake trace at the real shape."""
    check = calibration["self_check"]
    assert check["extrapolated"] == check["fake"]
    assert check["narrow"] == check["fake"]


def _traced_linear(tokens: int, width: int):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dynmo_plugin.profiling.op_trace import OpTrace
    with FakeTensorMode():
        lin = torch.nn.Linear(2048, width, bias=False, dtype=torch.bfloat16)
        x = torch.randn(tokens, 2048, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, width, dtype=torch.bfloat16)
        with OpTrace() as trace:
            lin(x).backward(grad)
    return trace


def test_a_token_count_is_no_leading_dimension_a_width_is():
    """An odd number of tokens (rows) leaves every pitch a multiple of 8: full rate; an
    odd width is the pitch of the output (forward) and of the gradients: slow rate."""
    rows = _traced_linear(4097, 2688)
    assert 4097 not in rows.leading_dims() and 4097 in rows.matmul_dims()
    assert rl.estimate(rows.ops).misaligned == 0
    wide = _traced_linear(4096, 2703)
    assert 2703 in wide.leading_dims()
    assert rl.estimate(wide.ops).misaligned == len(wide.matmuls()) == 3


_BROKEN_SCHEME = """
import sys
sys.path.insert(0, "scripts")
import roofline

def broken(shape):  # an injected fault: a scheme layer that no longer builds
    raise RuntimeError("this layer does not build")

roofline.SCHEMES.append(roofline.Scheme("broken", broken, roofline.GPU_BOUND, "plain", 0.5))
sys.exit(roofline.main(["--json", "--schemes", "broken"]))
"""


@pytest.mark.multiproc
def test_a_scheme_that_fails_to_build_is_a_row_and_json_is_one_document():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _BROKEN_SCHEME], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["scheme"]: r for r in json.loads(proc.stdout)["schemes"]}  # stdout: one document
    assert set(rows) == {"broken", "plain"}                              # with its reference
    assert rows["broken"]["error"] == "RuntimeError: this layer does not build"
    plain = rows["plain"]
    assert plain["ratio"] == 1.0 and plain["gpu_ms"] > plain["host_ms"] > 0   # GPU-bound shape
    assert plain["kernels"] == 50 and plain["misaligned_matmuls"] == 0


def test_real_traces_record_the_bf16_matmul_computed_in_fp32():
    """scripts/roofline_trace.py's Bf16MatmulInFp32: the trace keeps the layer's bf16 op
    (name, dtype, FLOPs, bytes); the value is the fp32 product rounded once."""
    import importlib.util

    import torch

    from dynmo_plugin.profiling.op_trace import OpTrace
    spec = importlib.util.spec_from_file_location("roofline_trace_for_test", ROOT / "scripts" / "roofline_trace.py")
    rt = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = rt  # its dataclasses look their module up
    try:
        spec.loader.exec_module(rt)
    finally:
        sys.modules.pop(spec.name)
    torch.manual_seed(0)
    a, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(32, 8, dtype=torch.bfloat16)
    bias = torch.zeros(8, dtype=torch.bfloat16)
    with rt.Bf16MatmulInFp32(), OpTrace() as trace:
        out = torch.addmm(bias, a, b)
    assert out.dtype is torch.bfloat16
    assert torch.equal(out, (a.float() @ b.float()).to(torch.bfloat16))
    (op,) = trace.ops
    assert (op.name, op.dtype, op.flops, op.bytes) == ("aten.addmm", "bfloat16", 2 * 16 * 32 * 8,
                                                       2 * (8 + 16 * 32 + 32 * 8 + 16 * 8))
