"""The launcher's rows at a host-bound and a GPU-bound shape: identical layers, heavy
layers at 2x and 3x, profiling overhead, stage prediction."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable, Optional

from gpu_checks import launching
from gpu_checks.common import CheckFailed, Machine, NO_CUDA, Row
from gpu_checks.launching import launch
from gpu_checks.rows_basic import _precision


# ---- the product's GPU acceptance (issues 24, 34) -----------------------------------------------
IDENTICAL_MAX, HEAVY_ACCEPT, OVERHEAD_MAX = 1.10, 0.10, 1.3
PREDICTION_ACCEPT = 0.10  # a stage's predicted time per iteration within 10% of the measured
KERNEL_COVERAGE_MIN = 0.98  # a GPU row fails where CUPTI dropped more kernel records (kernels.kernel_coverage)
THROUGHPUT_MAX, PLUGIN_OVERHEAD_MAX = 1.0, 1.03
THROUGHPUT_ROUNDS = 4     # interleaved rounds of throughput_vs_megatron_lm (issue 34: >= 4)
# Two heavy test layers at different factors: the cost of work k is c + k*w, so with
# neighbours (k=1) the fit gives the slope w and the intercept c (a constant per span,
# which read 3x as 2.63-2.73x on the H200). Run by the launcher worker (--gpu-check-heavy).
HEAVY_LAYERS = {3: 3, 5: 2}
_COMMON = ["--vocab-size", "32000", "--lr", "1e-4", "--transformer-impl", "local"]
SHAPES = {  # name: (model flags, what it is)
    "host": (["--num-layers", "12", "--hidden-size", "1024", "--num-attention-heads", "16",
              "--seq-length", "1024", "--micro-batch-size", "4", "--global-batch-size", "16"],
             "12L h1024 s1024 mb4 (host-bound)"),
    "gpu": (["--num-layers", "6", "--hidden-size", "4096", "--num-attention-heads", "32",
             "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size", "4"],
            "6L h4096 s2048 mb1 (GPU-bound)"),
}
SHAPE_RUN = ["--train-iters", "12", "--dynmo", "--dynmo-profile-every", "4", "--dynmo-profile-window", "1"]
# The dry run (no GPU): the host shape's rows run at this size on CPU, through the same
# launcher worker, run flags and verdicts, and print their figures unjudged (the bounds
# are GPU facts): every row's data path is exercised here before a GPU call reads it.
CPU_SHAPE = (["--num-layers", "6", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4"],
             "6L h256 s64 mb2 on CPU")


def timed_profiles(report: dict) -> list[dict]:
    """Every event's measured profile (profile windows and timed rebalances), in order."""
    return [e for e in report["events"] if e.get("profile") and not e.get("cancelled")
            and e.get("profile_source", "timed") == "timed"]


def layer_costs(profile: dict) -> dict[int, float]:
    return {x["layer"]: x["fwd_s"] + x["bwd_s"] for x in profile["layers"]}


def identical_verdict(profile: dict, exclude: tuple = ()) -> tuple[float, str]:
    """(max/min fwd+bwd over the layers not excluded, detail)."""
    costs = {n: c for n, c in layer_costs(profile).items() if n not in exclude}
    if len(costs) < 2 or min(costs.values()) <= 0:
        raise CheckFailed(f"too few timed layers in the profile: {costs}")
    ratio = max(costs.values()) / min(costs.values())
    ms = " ".join(f"{1e3 * costs[n]:.2f}" for n in sorted(costs))
    return ratio, f"max/min {ratio:.3f} (<= {IDENTICAL_MAX}) over {len(costs)} layers, ms: {ms}" + _times(profile)


def _times(profile: dict) -> str:
    """Host and GPU-kernel time beside the cost (docs/profiling.md: which one is used)."""
    stage = (profile.get("stages") or [{}])[0]
    if "cost_source" not in stage:
        return ""
    coverage = stage.get("kernel_coverage")
    return (f"; cost from {stage['cost_source']}, per iteration host {1e3 * stage.get('host_s', 0):.1f} ms, "
            f"GPU kernels {1e3 * stage.get('gpu_s', 0):.1f} ms"
            + (f" (records for {coverage:.2%} of launches)" if coverage is not None else "")
            + f", span constant {1e3 * stage.get('span_constant_s', 0):.3f} ms removed")


def heavy_slope_verdict(profile: dict, heavy: dict[int, int], tolerance: float) -> str:
    """Each heavy layer at its factor +-tolerance of its neighbours' median, and the fit
    cost = c + k*w through the neighbours (k=1) and the heavy layers: the intercept c
    within tolerance of 0 (in units of a neighbour's cost). Raises CheckFailed."""
    costs = layer_costs(profile)
    others = [c for n, c in costs.items() if n not in heavy]
    if not others or any(n not in costs for n in heavy):
        raise CheckFailed(f"layers {sorted(heavy)} or their neighbours missing from the profile ({sorted(costs)})")
    base = statistics.median(others)
    if base <= 0:
        raise CheckFailed(f"the neighbours' median cost is {base} s: no figures (layers {sorted(costs)})")
    ks = [1.0] * len(others) + [float(heavy[n]) for n in heavy]
    ys = [c / base for c in others] + [costs[n] / base for n in heavy]
    mk, my = statistics.fmean(ks), statistics.fmean(ys)
    slope = sum((k - mk) * (y - my) for k, y in zip(ks, ys)) / sum((k - mk) ** 2 for k in ks)
    intercept = my - slope * mk
    ratios = {n: costs[n] / base for n in heavy}
    detail = (", ".join(f"layer {n} {ratios[n]:.3f}x (expected {k}x)" for n, k in sorted(heavy.items()))
              + f" +-{tolerance:.0%}; fit cost = {intercept:+.3f} + {slope:.3f} x work (neighbour = 1; "
              f"intercept within +-{tolerance:.2f}); neighbour {1e3 * base:.2f} ms" + _times(profile))
    if any(abs(ratios[n] / k - 1) > tolerance for n, k in heavy.items()) or abs(intercept) > tolerance:
        raise CheckFailed(detail)
    return detail


def kernel_clock_problem(profile: dict, shape: str) -> Optional[str]:
    """On a GPU: why the profile's kernel clock cannot stand behind a row, or None. Every
    layer needs kernel time attributed (`gpu_s` > 0; a window whose backward ranges got no
    kernel records none), and the GPU-bound shape its costs from the kernels: without this
    a row passed on the host's launch time, which scales with the work too."""
    missing = [x["layer"] for x in profile["layers"] if not x.get("gpu_s")]
    if missing:
        return f"no GPU kernel time attributed to layers {missing} (the kernel clock failed: gpu_check.log)"
    coverage = profile["stages"][0].get("kernel_coverage")
    if coverage is not None and coverage < KERNEL_COVERAGE_MIN:
        return (f"kernel records for {coverage:.1%} of the kernel launches (under {KERNEL_COVERAGE_MIN:.0%}): "
                "CUPTI dropped the others")
    source = profile["stages"][0].get("cost_source")
    if shape.endswith("gpu") and source != "gpu_kernels":
        return f"costs from {source}, not the GPU kernels, at the GPU-bound shape"
    return None


def with_kernel_clock(m: Machine, shape: str, profiles: list[dict], passed: bool, detail: str) -> tuple[bool, str]:
    """(passed, detail) of a row, failed where a profile's kernel clock fails (GPU only)."""
    problem = next((p for p in (kernel_clock_problem(x, shape) for x in profiles) if p), None) if m.gpus else None
    return (False, f"{detail}; kernel clock: {problem}") if problem else (passed, detail)


def window_iterations(report: Optional[dict]) -> set[int]:
    """The iterations inside the report's profiling windows."""
    inside = set()
    for e in timed_profiles(report or {"events": []}):
        lo, hi = e.get("window") or [e["iteration"], e["iteration"]]
        inside.update(range(lo, hi + 1))
    return inside


def outside_windows(times: dict[int, float], report: Optional[dict], warmup: int) -> list[float]:
    """Iteration seconds after `warmup`, without the iterations inside profiling windows."""
    inside = window_iterations(report)
    return [t for i, t in sorted(times.items()) if i > warmup and i not in inside]


def prediction_verdict(report: dict, times: dict[int, float], warmup: int = 3) -> tuple[float, str]:
    """(worst predicted/measured - 1 over the timed profiles, detail): each profile's
    predicted stage time per iteration (layers + extras + optimizer step + rest of the step) against the
    median iteration outside windows."""
    measured = outside_windows(times, report, warmup)
    predicted = [e["profile"]["stages"][0].get("predicted_s", 0.0) for e in timed_profiles(report)]
    if not measured or not predicted or min(predicted) <= 0:
        raise CheckFailed(f"need predicted stage times ({predicted}) and iterations outside windows")
    outside = statistics.median(measured)
    worst = max((p / outside - 1 for p in predicted), key=abs)
    detail = (f"predicted {' '.join(f'{1e3 * p:.1f}' for p in predicted)} ms/iteration vs measured "
              f"{1e3 * outside:.1f} ms outside windows (median of {len(measured)}): worst {worst:+.1%} "
              f"(<= +-{PREDICTION_ACCEPT:.0%})")
    return worst, detail + _step_figures(report)


def _step_figures(report: dict) -> str:
    """What the prediction is made of and the step the controller timed around train_step
    (`measured_s`): a gap to the row's iterations that the step does not show is the loop
    between steps (Megatron-LM's logging), not the stage."""
    stages = [e["profile"]["stages"][0] for e in timed_profiles(report)]
    if not stages or "rest_s" not in stages[0]:
        return ""
    ms = lambda key: " ".join(f"{1e3 * s.get(key, 0.0):.1f}" for s in stages)  # noqa: E731
    return (f"; per profile: rest of the step {ms('rest_s')} ms (host) {ms('rest_gpu_s')} ms (GPU), "
            f"optimizer step {ms('step_s')} ms, "
            f"the step as timed around train_step {ms('measured_s')} ms")


def overhead_verdict(report: dict, warmup: int = 2) -> tuple[float, str]:
    """The training work of iterations inside profiling windows (their time less the
    plugin's own `dynmo_s`: closing a window stops the CUDA profiler, attributes its
    kernels and decides) over the other iterations'. The closing cost is reported beside
    it: it is paid once per window, after an event or every `--dynmo-profile-every`."""
    inside = window_iterations(report)
    rows = {i["iteration"]: i for i in report["iterations"] if i["iteration"] > warmup}
    a = [r["time_s"] - r.get("dynmo_s", 0.0) for i, r in rows.items() if i in inside]
    b = [r["time_s"] for i, r in rows.items() if i not in inside]
    if not a or not b:
        raise CheckFailed(f"need profiled and unprofiled iterations after warm-up: {sorted(inside)}")
    closing = statistics.median([r.get("dynmo_s", 0.0) for i, r in rows.items() if i in inside])
    ratio = statistics.median(a) / statistics.median(b)
    # each unprofiled iteration in order: one before the first window against those after
    # it shows a cost the profiler leaves behind (CUPTI kept attached after the window)
    order = " ".join(f"{i}:{1e3 * r['time_s']:.1f}" for i, r in rows.items() if i not in inside)
    return ratio, (f"profiled {1e3 * statistics.median(a):.1f} ms / unprofiled "
                   f"{1e3 * statistics.median(b):.1f} ms = {ratio:.3f}x (<= {OVERHEAD_MAX}x); "
                   f"closing a window {1e3 * closing:.1f} ms once (profiler stop, kernel attribution, decision); "
                   f"unprofiled ms by iteration {order}")


class Runs:
    """Launches shared by several rows: run once, the first row pays the seconds."""

    def __init__(self):
        self._done: dict[str, object] = {}

    def get(self, key: str, start: Callable[[], object]) -> object:
        if key not in self._done:
            try:
                self._done[key] = start()
            except CheckFailed as e:
                self._done[key] = e
            except Exception as e:  # noqa: BLE001 - every row sharing the run fails with it
                self._done[key] = CheckFailed(f"{type(e).__name__}: {e}"[:300])
        value = self._done[key]
        if isinstance(value, CheckFailed):  # its kind kept: a run the budget stopped is "skipped: budget"
            raise type(value)(f"(shared run {key}) {value}")
        return value


def _heavy_flag() -> list[str]:
    return ["--gpu-check-heavy", ",".join(f"{n}:{k}" for n, k in sorted(HEAVY_LAYERS.items()))]


def shape_run(m: Machine, shape: str, out: Path, runs: Runs) -> dict:
    flags, _ = SHAPES[shape] if m.gpus else CPU_SHAPE
    return runs.get(f"shape-{shape}", lambda: launch(
        1, [*flags, *_COMMON, *SHAPE_RUN, *_precision(m), *_heavy_flag()], out / f"shape_{shape}"))


def shape_row(name: str, m: Machine, shape: str, judge: Callable[[], tuple[bool, str]]) -> Row:
    """`judge()` -> (passed, detail). On a GPU: pass, or CheckFailed with the detail. In
    the dry run (the launcher worker started, no GPU): the host shape's row runs at
    CPU_SHAPE and is 'skipped: no CUDA' with its figures, or with why they are missing;
    the GPU shape's is not run."""
    if m.gpus:
        passed, detail = judge()
        if not passed:
            raise CheckFailed(detail)
        return Row(name, "pass", detail)
    if shape != "host" or launching.WORKER is None:
        return Row(name, NO_CUDA)
    try:
        detail = judge()[1]
    except CheckFailed as e:
        detail = f"no figures: {e}"
    return Row(name, NO_CUDA, f"ran on CPU (not judged): {detail}")


def _shape_text(m: Machine, shape: str) -> str:
    return SHAPES[shape][1] if m.gpus else CPU_SHAPE[1]


def check_identical(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    def judge() -> tuple[bool, str]:
        profile = timed_profiles(shape_run(m, shape, out, runs))[-1]["profile"]
        ratio, detail = identical_verdict(profile, exclude=tuple(HEAVY_LAYERS))
        return with_kernel_clock(m, shape, [profile], ratio <= IDENTICAL_MAX,
                                 f"{_shape_text(m, shape)}, launcher: {detail}")
    return shape_row(f"identical_layers[{shape}]", m, shape, judge)


def check_heavy(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    def judge() -> tuple[bool, str]:
        profile = timed_profiles(shape_run(m, shape, out, runs))[-1]["profile"]
        try:
            passed, detail = True, heavy_slope_verdict(profile, HEAVY_LAYERS, HEAVY_ACCEPT)
        except CheckFailed as e:
            passed, detail = False, str(e)
        return with_kernel_clock(m, shape, [profile], passed, f"{_shape_text(m, shape)}: {detail}")
    return shape_row(f"heavy_layer[{shape}]", m, shape, judge)


def check_overhead(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    def judge() -> tuple[bool, str]:
        ratio, detail = overhead_verdict(shape_run(m, shape, out, runs))
        return ratio <= OVERHEAD_MAX, f"{_shape_text(m, shape)}: {detail}"
    return shape_row(f"profiling_overhead[{shape}]", m, shape, judge)


def check_prediction(m: Machine, shape: str, out: Path, runs: Runs) -> Row:
    """The launcher: the profile's predicted stage time against iterations outside windows."""
    def judge() -> tuple[bool, str]:
        report = shape_run(m, shape, out, runs)
        worst, detail = prediction_verdict(report, {i["iteration"]: i["time_s"] for i in report["iterations"]})
        return with_kernel_clock(m, shape, [e["profile"] for e in timed_profiles(report)],
                                 abs(worst) <= PREDICTION_ACCEPT, f"{_shape_text(m, shape)}, launcher: {detail}")
    return shape_row(f"stage_prediction[{shape}]", m, shape, judge)
