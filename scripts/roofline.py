"""Predict, before a GPU run, what each scheme's layer costs on an H200 / H100.

Builds the real Megatron-Core layers (--transformer-impl local, bf16): a plain
TransformerLayer and each scheme's layer as this checkout has it, at a GPU-bound shape,
traces one forward + backward with `OpTrace` on the fake device (FakeTensorMode: real
shapes, no memory, no arithmetic) and prices it with `dynmo_plugin.profiling.roofline`.
A layer whose sizes depend on values (FakeTensorMode cannot answer) is traced for real
on CPU at short sequences and extrapolated in s, or at a narrow hidden size and widened
(scripts/roofline_trace.py; the row's note says which).

    python scripts/roofline.py                 # the scheme table (H200)
    python scripts/roofline.py --calibrate     # predicted vs measured for CALIBRATION
    python scripts/roofline.py --fit           # refit the constants over CALIBRATION
    python scripts/roofline.py --json          # one JSON document on stdout, logs on stderr

A scheme is one entry of SCHEMES: a builder (config, shape) -> Case. A builder that
fails gives a row with its error, not a crash. docs/roofline.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline_trace  # noqa: E402
import torch  # noqa: E402
from roofline_trace import (ATTENTION, BF16, GPU_BOUND, Case, Shape, base_spec, build,  # noqa: E402
                            causal_mask, config_for, megatron_process, plain_run, trace_case,
                            trace_real_extrapolated, trace_real_narrow, trace_scheme)

from dynmo_plugin.profiling import roofline as rl  # noqa: E402
from dynmo_plugin.profiling.op_trace import OpRecord, OpTrace  # noqa: E402

log = logging.getLogger("roofline")


# ---- the scheme layers ----------------------------------------------------------------------
def plain(shape: Shape) -> Case:
    return Case(build(base_spec(), config_for(shape)), lambda m, x, s: plain_run(m, x, s.seq))


def frozen(shape: Shape) -> Case:
    """A frozen-prefix layer: forward only (nothing before it needs a gradient)."""
    from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
    layer = build(freezable_spec(base_spec()), config_for(shape))
    layer.set_frozen(True)
    return Case(layer, lambda m, x, s: plain_run(m, x, s.seq), backward=False,
                note="frozen prefix: forward only")


def pruned(keep: float, align: int = 1) -> Callable[[Shape], Case]:
    """Structured pruning: the FFN keeps `keep` of its neurons, physically shrunk (the
    scheme's own NeuronPrunable linears, width rounded to `align` as the scheme would)."""
    def make(shape: Shape) -> Case:
        from dynmo_plugin.scenarios.gradual_pruning.layer import neuron_prunable_layer_spec
        from dynmo_plugin.scenarios.shapes import round_nearest
        layer = build(neuron_prunable_layer_spec(base_spec()), config_for(shape))
        full = layer.mlp.linear_fc1.full_width
        width = round_nearest(round(keep * full), align, full) if align > 1 else round(keep * full)
        present = torch.arange(width)
        for lin, axis in ((layer.mlp.linear_fc1, 0), (layer.mlp.linear_fc2, 1)):
            kept = torch.zeros(full, dtype=torch.bool)
            kept[:width] = True
            lin.weight_mask &= kept[:, None] if axis == 0 else kept[None, :]
            lin.resize_neurons(width, present)
            lin.to(BF16)
            lin.refresh()
        return Case(layer, lambda m, x, s: plain_run(m, x, s.seq), note=f"FFN width {width} of {full}")
    return make


def mod(capacity: float) -> Callable[[Shape], Case]:
    def make(shape: Shape) -> Case:
        from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext, mod_spec
        from dynmo_plugin.scenarios.mixture_of_depths.live import _predictor_width
        width = _predictor_width(shape.hidden)   # the scenario's predictor (h/8)
        layer = build(mod_spec(base_spec(), {5: capacity}, width), config_for(shape))
        layer.mod_context = ModContext(predictor_loss_weight=0.01, grad_scale=1.0)
        return Case(layer, lambda m, x, s: plain_run(m, x, s.seq),
                    note=f"capacity {capacity}, predictor width {width}")
    return make


def early_exit(exited: float, vocab: int = 32000, number: int = 6) -> Callable[[Shape], Case]:
    """Layer `number` of 8 (exits from layer 4 on) after `exited` of the tokens left at
    earlier layers (layers <= 4 gather nothing: no token can have exited yet)."""
    def make(shape: Shape) -> Case:
        from dynmo_plugin.scenarios.early_exit.layer import ExitContext, early_exit_spec, encode_exited
        cfg = config_for(shape)
        layer = build(early_exit_spec(base_spec(), vocab_size=vocab), cfg, number=number)
        s, b, h = shape.seq, shape.batch, shape.hidden
        labels = torch.zeros(s, b, dtype=torch.long)
        layer.exit_context = ExitContext(seq_length=s, threshold=0.2, min_layer=4, exits_on=True,
                                         loss_weight=0.5, grad_scale=1.0, labels=[labels] * 4,
                                         loss_masks=[torch.ones(s, b)] * 4)
        flags = torch.zeros(s, b, dtype=torch.bool)
        flags[: int(exited * s)] = True

        def run(m, x, sh):
            carrier = encode_exited(flags, h, x.dtype)
            out, _ = m(hidden_states=torch.cat([x, carrier]), attention_mask=causal_mask(sh.seq))
            return out
        return Case(layer, run, real=number > 4 and exited > 0, note=f"{exited:.0%} of tokens exited before")
    return make


def moe(capacity_factor: float, pad: bool = True, sdpa: bool = False) -> Callable[[Shape], Case]:
    """The scheme's MoE layer as the scheme configures it (MixtureOfExperts.layer_spec and
    configure_model: 8 experts, top-2, capacity rounded to 64 tokens, every expert padded
    to its capacity: index dispatch and batched experts, scenarios/moe/layer.py; unless
    `pad` is False, the scheme's --dynmo-moe-no-pad: Megatron's allgather dispatcher and
    per-expert loop), its weights initialised as a model's are (norms 1,
    others N(0, 0.02)): uninitialised weights (the launcher's config leaves that to
    init_by_global_name) made the router send every token to the same two experts on
    the GPU probe. `sdpa`: the layers' core attention torch's fused causal SDPA
    (VarlenCoreAttention, unpacked) instead of Megatron's unfused local one, in the dense
    spec the MoE layer takes its attention from: what the ratio becomes once the base
    spec's attention is fused."""
    def make(shape: Shape) -> Case:
        from dynmo_plugin.config import DynamismConfig, ModelArgs
        from dynmo_plugin.scenarios.moe.live import MixtureOfExperts
        settings = DynamismConfig(kind="moe")
        m = settings.moe
        m.num_experts, m.top_k, m.capacity_factor, m.aux_loss_coeff, m.no_pad = \
            8, 2, capacity_factor, 0.01, not pad
        # the capacities of these rows are multiples of 64 (the scheme's granularity)
        # either way; 8 keeps them proportional to s at the short sequences of the
        # extrapolated trace, where 64 rounded every one to a single granule
        m.granularity = 8
        scheme = MixtureOfExperts(settings)
        cfg = config_for(shape)
        base = base_spec()
        if sdpa:
            from dynmo_plugin.megatron.attention.varlen import varlen_attention_spec
            base = varlen_attention_spec(base)
        spec = scheme.layer_spec(base, ModelArgs(
            num_layers=cfg.num_layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            seq_length=shape.seq, micro_batch_size=shape.batch))
        scheme.configure_model(cfg)
        layer = build(spec, cfg)
        with torch.no_grad():  # on the CPU (shapes only) large matrices are zeroed, not
            for name, p in layer.named_parameters():  # drawn: ~45 s a layer at h4096
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif p.device.type != "cpu" or p.numel() <= 1 << 20:
                    p.normal_(0, 0.02)
                else:
                    p.zero_()
        return Case(layer, lambda m, x, s: plain_run(m, x, s.seq), real=True,
                    note=f"8 experts top-2, capacity {scheme.capacity} per expert"
                         + (", padded" if cfg.moe_pad_expert_input_to_capacity else ", unpadded")
                         + (", SDPA attention" if sdpa else ""))
    return make


def lsh(buckets: int) -> Callable[[Shape], Case]:
    def make(shape: Shape) -> Case:
        from dynmo_plugin.scenarios.sparse_attention.layer import lsh_attention_spec
        layer = build(lsh_attention_spec(base_spec(), seed=1, initial_buckets={5: buckets}, hashes=1),
                      config_for(shape))
        layer.self_attention.core_attention.begin_iteration(1)
        return Case(layer, lambda m, x, s: m(hidden_states=x, attention_mask=None)[0],
                    note=f"{buckets} hash buckets" if buckets > 1 else "dense causal SDPA")
    return make


SDPA_SHAPE = Shape(4096, 32, 4096, 2)    # the GPU check's scenario rows, --attention-backend sdpa
LONG = Shape(1024, 8, 16384, 1)           # sparse attention where attention dominates
LONGER = Shape(1024, 8, 32768, 1)         # sparse attention's live row (rows_scenarios.py)
MOD_SHAPE = Shape(4096, 32, 4096, 4)      # Mixture of Depths' scenario row, --attention-backend sdpa


@contextmanager
def attention_backend(name: str):
    """Build the layers with --attention-backend `name` (roofline_trace.base_spec reads it)."""
    old, roofline_trace.ATTENTION_BACKEND = roofline_trace.ATTENTION_BACKEND, name
    try:
        yield
    finally:
        roofline_trace.ATTENTION_BACKEND = old


@dataclass(frozen=True)
class Scheme:
    name: str
    make: Callable[[Shape], Case]
    shape: Shape
    reference: str          # the row the ratio is taken against
    target: Optional[float]  # the issue's acceptance ratio (<=)
    backend: str = "unfused"  # --attention-backend of the layers
    measured: Optional[str] = None  # scripts/layer_probe.py's case (rl.CALIBRATION), if measured


_SDPA = " sdpa"
SCHEMES: list[Scheme] = [
    Scheme("plain", plain, GPU_BOUND, "plain", None, measured="plain h4096 s2048 mb1"),
    Scheme("layer_freezing (frozen prefix)", frozen, GPU_BOUND, "plain", 0.4,
           measured="frozen h4096 s2048 mb1"),
    Scheme("gradual_pruning 67% (odd width)", pruned(0.33), GPU_BOUND, "plain", 0.75),
    Scheme("gradual_pruning 67% (width /128)", pruned(0.33, 128), GPU_BOUND, "plain", 0.75,
           measured="pruned67/128 h4096 s2048 mb1"),
    Scheme("mixture_of_depths capacity 0.125", mod(0.125), GPU_BOUND, "plain", 0.3,
           measured="mod0.125 h4096 s2048 mb1"),
    Scheme("early_exit tail (75% exited)", early_exit(0.75), GPU_BOUND, "plain", 0.6),
    Scheme("moe capacity 1.0", moe(1.0), GPU_BOUND, "plain", None),
    Scheme("moe capacity 0.5", moe(0.5), GPU_BOUND, "moe capacity 1.0", 0.8),
    Scheme("moe capacity 1.0 unpadded", moe(1.0, pad=False), GPU_BOUND, "plain", None),
    Scheme("moe capacity 0.5 unpadded", moe(0.5, pad=False), GPU_BOUND, "moe capacity 1.0 unpadded", None),
    Scheme("moe capacity 1.0 SDPA attention", moe(1.0, sdpa=True), GPU_BOUND, "plain", None),
    Scheme("moe capacity 0.5 SDPA attention", moe(0.5, sdpa=True), GPU_BOUND,
           "moe capacity 1.0 SDPA attention", 0.8),
    # the GPU check's scenario shape with --attention-backend sdpa
    Scheme("plain" + _SDPA, plain, SDPA_SHAPE, "plain" + _SDPA, None, "sdpa",
           "plain h4096 s4096 mb2 sdpa"),
    Scheme("layer_freezing (frozen prefix)" + _SDPA, frozen, SDPA_SHAPE, "plain" + _SDPA, 0.4, "sdpa",
           "frozen h4096 s4096 mb2 sdpa"),
    Scheme("gradual_pruning 67% (width /128)" + _SDPA, pruned(0.33, 128), SDPA_SHAPE, "plain" + _SDPA,
           0.75, "sdpa", "pruned67/128 h4096 s4096 mb2 sdpa"),
    Scheme("mixture_of_depths capacity 0.125" + _SDPA, mod(0.125), SDPA_SHAPE, "plain" + _SDPA, 0.3,
           "sdpa"),
    # Mixture of Depths' scenario row: micro-batch 4 (its layer is host-bound at 2)
    Scheme("plain sdpa mb4", plain, MOD_SHAPE, "plain sdpa mb4", None, "sdpa"),
    Scheme("mixture_of_depths capacity 0.125 sdpa mb4", mod(0.125), MOD_SHAPE, "plain sdpa mb4", 0.3,
           "sdpa"),
    # scenario_cost[moe]'s shape: FFN 4h (16384) per expert, about Mixtral 8x7B's (14336)
    Scheme("moe capacity 1.0" + _SDPA, moe(1.0), SDPA_SHAPE, "plain" + _SDPA, None, "sdpa"),
    Scheme("moe capacity 0.5" + _SDPA, moe(0.5), SDPA_SHAPE, "moe capacity 1.0" + _SDPA, 0.8, "sdpa"),
    Scheme("early_exit tail (75% exited)" + _SDPA, early_exit(0.75), SDPA_SHAPE, "plain" + _SDPA, 0.6,
           "sdpa", "early_exit75 h4096 s4096 mb2 sdpa"),
    Scheme("sparse_attention dense (1 bucket)", lsh(1), ATTENTION, "sparse_attention dense (1 bucket)", None,
           measured="lsh1 h1024 s8192 mb1"),
    Scheme("sparse_attention 16 buckets", lsh(16), ATTENTION, "sparse_attention dense (1 bucket)", 0.8),
    Scheme("sparse_attention dense (1 bucket) s16384", lsh(1), LONG,
           "sparse_attention dense (1 bucket) s16384", None, measured="lsh1 h1024 s16384 mb1"),
    Scheme("sparse_attention 16 buckets s16384", lsh(16), LONG, "sparse_attention dense (1 bucket) s16384",
           0.8),
    Scheme("sparse_attention dense (1 bucket) s32768", lsh(1), LONGER,
           "sparse_attention dense (1 bucket) s32768", None, measured="lsh1 h1024 s32768 mb1"),
    Scheme("sparse_attention 16 buckets s32768", lsh(16), LONGER, "sparse_attention dense (1 bucket) s32768",
           0.8),
]


def _measured(row: dict, case: str) -> None:
    """The measured GPU and host ms of `case` (rl.CALIBRATION) into `row`."""
    row["measured_gpu_ms"] = rl.measured(case, "gpu") * 1e3
    row["measured_host_ms"] = rl.measured(case, "host") * 1e3
    row["measured_case"] = case


def _ratios(row: dict, ref: dict) -> None:
    if "bound_ms" in row and "bound_ms" in ref:
        row["ratio"] = row["bound_ms"] / ref["bound_ms"]
        row["gpu_ratio"] = row["gpu_ms"] / ref["gpu_ms"]
        if row["target"] is not None:
            row["meets_target"] = row["ratio"] <= row["target"]
    if "measured_gpu_ms" in row and "measured_gpu_ms" in ref:
        row["measured_gpu_ratio"] = row["measured_gpu_ms"] / ref["measured_gpu_ms"]
        row["measured_ratio"] = (max(row["measured_gpu_ms"], row["measured_host_ms"])
                                 / max(ref["measured_gpu_ms"], ref["measured_host_ms"]))


def scheme_rows(hw: rl.Hardware, names: Optional[list[str]] = None) -> list[dict]:
    rows: dict[str, dict] = {}
    wanted = set(names or ()) | {sc.reference for sc in SCHEMES if sc.name in (names or ())}
    wanted |= {sc.reference for sc in SCHEMES if sc.name in wanted}
    for sc in SCHEMES:
        if names and sc.name not in wanted:
            continue
        t0 = time.time()
        row = {"scheme": sc.name, "shape": sc.shape.label, "target": sc.target, "reference": sc.reference,
               "backend": sc.backend}
        if sc.measured:
            _measured(row, sc.measured)
        try:
            with attention_backend(sc.backend):
                ops, how, passes = trace_scheme(sc.make, sc.shape)
            est = rl.estimate(ops, hw, passes=passes)
            slow = [f"{op.name}{list(op.inputs)} pitch {op.leading_dims()}" for op in ops
                    if op.kernel and op.is_matmul and rl.alignment_factor(op, rl.H200_CONSTANTS) < 1]
            row.update(gpu_ms=est.gpu_s * 1e3, host_ms=est.host_s * 1e3, bound_ms=est.bound_s * 1e3,
                       bound=est.bound, kernels=est.kernels, gflop=est.flops / 1e9,
                       gbytes=est.bytes / 1e9, misaligned_matmuls=est.misaligned,
                       misaligned_examples=slow[:3], how=how)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log.debug("%s", traceback.format_exc())
        row["seconds"] = round(time.time() - t0, 1)
        log.info("%s: %s", sc.name, row.get("error") or f"{row['bound_ms']:.2f} ms ({row['bound']})")
        for example in row.get("misaligned_examples", []):
            log.info("  misaligned: %s", example)
        rows[sc.name] = row
    for row in rows.values():
        ref = rows.get(row["reference"])
        if ref:
            _ratios(row, ref)
    return list(rows.values())


# ---- calibration traces -----------------------------------------------------------------------
def _ffn_probe(width: int) -> list[OpRecord]:
    """The probe: two linears and a GELU, h2048, 4096 tokens, fwd + bwd (pure torch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fc1, fc2 = torch.nn.Linear(2048, width, dtype=BF16), torch.nn.Linear(width, 2048, dtype=BF16)
        x = torch.randn(4096, 2048, dtype=BF16, requires_grad=True)
        g = torch.randn(4096, 2048, dtype=BF16)
        with OpTrace() as trace:
            torch.autograd.backward(fc2(torch.nn.functional.gelu(fc1(x))), g)
    return trace.ops


def _sdpa_probe(chunks: int) -> list[OpRecord]:
    """SDPA causal, b1 n8 s8192 d128, as [b*n*chunks, 1, s/chunks, d]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = (torch.randn(8 * chunks, 1, 8192 // chunks, 128, dtype=BF16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(8 * chunks, 1, 8192 // chunks, 128, dtype=BF16)
        with OpTrace() as trace:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.backward(out, g)
    return trace.ops


def calibration_traces() -> dict[str, list[OpRecord]]:
    """A trace for every row of roofline.CALIBRATION, by `CalibrationRow.trace`: the
    kernel probes, and scripts/layer_probe.py's cases built by that script's own list
    (the same builders it measured)."""
    import layer_probe
    makers: dict[str, Callable[[], list[OpRecord]]] = {
        "SDPA causal b1 n8 s8192 d128": lambda: _sdpa_probe(1),
        "SDPA causal 16 chunks of 512": lambda: _sdpa_probe(16),
    }
    for w in (8192, 2703, 2730, 2688, 2736):
        makers[f"FFN h2048 T4096 width {w}"] = lambda w=w: _ffn_probe(w)
    layers = {name: (make, shape) for name, make, shape, _ in layer_probe.cases()}
    backends = {row.trace: row.backend for row in rl.CALIBRATION}
    for name in backends:
        if name in layers:
            make, shape = layers[name]
            makers[name] = lambda make=make, shape=shape, b=backends[name]: _traced_with(b, make, shape)
    out = {}
    for name, make in makers.items():
        t0 = time.time()
        try:
            out[name] = make()
        except Exception as e:  # a scheme layer that no longer builds: its row is skipped
            log.warning("calibration row %r not traced: %s: %s", name, type(e).__name__, e)
        log.debug("traced %s in %.1f s", name, time.time() - t0)
    return out


def _traced_with(backend: str, make: Callable[[Shape], Case], shape: Shape) -> list[OpRecord]:
    with attention_backend(backend):
        return trace_scheme(make, shape)[0]


SELF_CHECK = Shape(2048, 32, 1024, 2)


def self_check() -> dict:
    """The two fallbacks against the fake trace, on a plain layer (which all three can
    trace): {method: {flops, bytes, kernels, misaligned, gpu_ms}}; equal when sound."""
    out = {}
    for method, trace in (("fake", lambda: trace_case(plain(SELF_CHECK), SELF_CHECK)),
                          ("extrapolated", lambda: trace_real_extrapolated(plain, SELF_CHECK)),
                          ("narrow", lambda: trace_real_narrow(plain, SELF_CHECK))):
        est = rl.estimate(trace())
        out[method] = {"flops": est.flops, "bytes": est.bytes, "kernels": est.kernels,
                       "misaligned": est.misaligned, "gpu_ms": est.gpu_s * 1e3}
    return out


def calibration_rows(traces, hw: rl.Hardware, c: rl.Constants) -> list[dict]:
    out = []
    for row in rl.CALIBRATION:
        base = {"row": row.name, "kind": row.kind, "code": row.code, "backend": row.backend,
                "measured_ms": row.measured_s * 1e3, "measured_kernels": row.kernels, "source": row.source}
        if row.trace not in traces:
            out.append(base | {"error": None, "skipped": "not traced"})
            continue
        est = rl.estimate(traces[row.trace], hw, c, row.passes)
        pred = rl.predict_row(row, est, c)
        out.append(base | {"predicted_ms": pred * 1e3, "error": pred / row.measured_s - 1,
                           "gpu_ms": est.gpu_s * 1e3, "host_ms": est.host_s * 1e3, "kernels": est.kernels,
                           "gflop": est.flops / 1e9})
    return out


# ---- output -----------------------------------------------------------------------------------
def _fmt(v, spec=".2f") -> str:
    width = spec.split(".")[0]
    return format("-", ">" + width) if v is None else format(v, spec)


def print_schemes(rows: list[dict], hw: rl.Hardware) -> None:
    print(f"Predicted forward+backward per layer on one {hw.name} (bf16, --transformer-impl local); "
          "measured: scripts/layer_probe.py on an H200 (GPU = kernel busy time, host = enqueue)")
    print(f"{'scheme':44} {'shape':17} {'GPU ms':>7} {'host ms':>8} {'ratio':>6} {'GPU x':>6} "
          f"{'meas GPU':>8} {'meas host':>9} {'meas x':>6} {'GPU x':>6} {'target':>7}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['scheme']:44} {r['shape']:17} ERROR {r['error'][:90]}")
            continue
        target = f"<={r['target']}" if r["target"] is not None else ""
        mark = "" if "meets_target" not in r else (" ok" if r["meets_target"] else " MISS")
        print(f"{r['scheme']:44} {r['shape']:17} {r['gpu_ms']:7.2f} {r['host_ms']:8.2f} "
              f"{_fmt(r.get('ratio'), '6.3f')} {_fmt(r.get('gpu_ratio'), '6.3f')} "
              f"{_fmt(r.get('measured_gpu_ms'), '8.2f')} {_fmt(r.get('measured_host_ms'), '9.2f')} "
              f"{_fmt(r.get('measured_ratio'), '6.3f')} {_fmt(r.get('measured_gpu_ratio'), '6.3f')} "
              f"{target:>7}{mark:5} "
              f"{r['kernels']} kernels, {r['misaligned_matmuls']} misaligned; {r['how']}")


def print_calibration(rows: list[dict]) -> None:
    print(f"{'calibration row (H200 measured)':44} {'kind':5} {'measured':>8} {'predicted':>9} "
          f"{'error':>7} {'GPU':>6} {'host':>6} kernels traced/measured")
    for r in rows:
        name = r["row"] + ("" if r["code"] == "plain" else " *")
        if r.get("skipped"):
            print(f"{name:44} {r['kind']:5} {r['measured_ms']:8.3f} {r['skipped']}")
            continue
        print(f"{name:44} {r['kind']:5} {r['measured_ms']:8.3f} {r['predicted_ms']:9.3f} "
              f"{r['error']:+7.1%} {r['gpu_ms']:6.2f} {r['host_ms']:6.2f} {r['kernels']}"
              + (f"/{r['measured_kernels']}" if r["measured_kernels"] else ""))
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    plain = [abs(r["error"]) for r in rows if r["error"] is not None and r["code"] == "plain"]
    print(f"max |error| {max(errors):.1%}, of the unmarked rows {max(plain):.1%} (stated bound "
          f"{rl.CALIBRATION_MAX_ERROR:.0%}); * = a scheme layer as measured (its code may change)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", choices=["h200", "h100"], default="h200")
    ap.add_argument("--calibrate", action="store_true", help="predicted vs measured per calibration row")
    ap.add_argument("--fit", action="store_true", help="refit the constants over the calibration rows")
    ap.add_argument("--schemes", help="comma-separated scheme names (default all)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, stream=sys.stderr,
                        format="%(message)s")
    known = {sc.name for sc in SCHEMES}
    names = [n.strip() for n in a.schemes.split(",")] if a.schemes else None
    if names and set(names) - known:
        print(f"roofline: unknown scheme(s) {sorted(set(names) - known)}; known: {sorted(known)}",
              file=sys.stderr)
        return 2
    hw = rl.H200 if a.hardware == "h200" else rl.H100
    torch.manual_seed(0)
    torch.set_num_threads(1)
    megatron_process()
    doc: dict = {"hardware": dataclasses.asdict(hw), "constants": dataclasses.asdict(rl.H200_CONSTANTS)}
    if a.calibrate or a.fit:
        traces = calibration_traces()
        if a.fit:
            best, err = rl.fit(traces, rl.H200)
            doc["fit"] = {"constants": dataclasses.asdict(best), "max_error": err}
            log.info("fit: %s max error %.1f%%", best, 100 * err)
        doc["calibration"] = calibration_rows(traces, rl.H200, rl.H200_CONSTANTS)
        doc["self_check"] = self_check()
    else:
        doc["schemes"] = scheme_rows(hw, names)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    elif "calibration" in doc:
        print_calibration(doc["calibration"])
        print(f"plain layer {SELF_CHECK.label} ({SELF_CHECK.heads} heads) by each tracing method:")
        for method, r in doc["self_check"].items():
            print(f"  {method:12} {r['flops'] / 1e9:10.3f} GFLOP {r['bytes'] / 1e9:8.4f} GB "
                  f"{r['kernels']:4} kernels {r['misaligned']} misaligned {r['gpu_ms']:.3f} ms")
        if "fit" in doc:
            print("fit:", doc["fit"])
    else:
        print_schemes(doc["schemes"], hw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
