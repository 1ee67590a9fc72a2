"""GPU busy time per layer: the durations of the kernels each layer launched.

A span between two CUDA events after a synchronisation measures max(host launch time,
GPU time) plus a fixed cost (docs/profiling.md). The kernels' own durations, from the
CUDA profiler (CUPTI through `torch.profiler`), are the GPU's work alone: no host gaps,
no idle GPU while the host prepares the first kernel. They are collected inside
profiling windows only (the profiler runs from the window's first to its last
iteration); on CPU nothing is started (`KernelBusy(enabled=False)`: every method is a
no-op).

Attribution: every span the probe times is also a `record_function` range named
`dynmo:<iteration>:<span key>:<micro-batch>`, and the profiler records user-scope ranges
only (`start_profiler`: not every aten op, which cost 1.4-1.8x on the host). It links
each kernel to the host event that launched it (`linked_correlation_id`: the innermost
recorded range; else its own `correlation_id`: the runtime's launch call); the kernel
belongs to the innermost range that holds that launch on the same host thread
(`attribute`, pure, tested on CPU with real profiler events and with synthetic ones).

The host thread is the OS thread (`device_resource_id`), never `start_thread_id`. With
user-scope ranges only, torch pushes their ids on kineto's *user* correlation flow,
while kineto links kernels and runtime calls through the default one: every kernel's
linked id is 0 and no runtime call has a parent, and a parentless kineto event takes
the `start_thread_id` of the thread that stops the profiler (torch's `setKinetoTID`).
Every launch, autograd's device thread's included, would read as the training
thread's, and no backward range (recorded on the device thread) could hold one. A
runtime call's `device_resource_id` is CUPTI's thread mapped to the OS thread id by
kineto (`recordThreadInfo`, which torch calls for each thread that records a range),
the same id our ranges carry.

Detached after each window: kineto leaves CUPTI attached when a profiler stops unless
TEARDOWN_CUPTI=1 (kineto's `cuptiTearDown_` reads the variable each time and is false
when it is unset, the default still in 2026: kineto#1539 is open), and an attached CUPTI
slows every later iteration by 10-20% (pytorch#144455). (The H200 call's plugin/plain
1.19-1.27x was not this: it ran at ea03802, before the plugin had any CUDA profiler.)
`release_cupti_after_windows` sets it where the user has not, on CUDA 12.6 or newer
(before, a teardown crashed CUDA graphs' next CUPTI start; torch sets it to 0 itself
where it needs that).
"""
from __future__ import annotations

import bisect
import logging
import os
import re
from collections import defaultdict
from typing import Hashable, NamedTuple, Optional

__all__ = ["KernelBusy", "Range", "attribute", "busy_by_range", "range_name", "parse_range",
           "release_cupti_after_windows", "start_profiler", "stop_profiler"]

logger = logging.getLogger(__name__)
PREFIX = "dynmo:"


class Range(NamedTuple):
    name: str
    thread: int
    start_ns: int
    end_ns: int


def range_name(iteration: int, key: str, mb: int) -> str:
    return f"{PREFIX}{iteration}:{key}:{mb}"


def parse_range(name: str) -> tuple[int, str, int]:
    """(iteration, span key, micro-batch) of a range name."""
    iteration, rest = name[len(PREFIX):].split(":", 1)
    key, mb = rest.rsplit(":", 1)
    return int(iteration), key, int(mb)


def attribute(ranges: list[Range], launches: dict[Hashable, tuple[int, int]],
              kernels: list[tuple[Hashable, int]]) -> dict[str, int]:
    """Kernel nanoseconds per range name. `launches`: launch key -> (host thread, host
    time in ns) of the event that launched it (`from_kineto`: ("op" | "runtime", id));
    `kernels`: (launch key, duration in ns). A kernel whose launch is in no range
    (optimizer, outside spans) is not attributed; in nested ranges the innermost (latest
    start) holds it."""
    by_thread: dict[int, list[Range]] = defaultdict(list)
    for r in ranges:
        by_thread[r.thread].append(r)
    starts = {}
    for thread, items in by_thread.items():
        items.sort(key=lambda r: r.start_ns)
        starts[thread] = [r.start_ns for r in items]
    busy: dict[str, int] = defaultdict(int)
    for corr, duration in kernels:
        launch = launches.get(corr)
        if launch is None or launch[0] not in by_thread:
            continue
        thread, at = launch
        items = by_thread[thread]
        i = bisect.bisect_right(starts[thread], at) - 1
        while i >= 0:  # latest-starting range that still holds `at`
            if items[i].end_ns >= at:
                busy[items[i].name] += duration
                break
            i -= 1
    return dict(busy)


def from_kineto(events, keep=None) -> tuple[list[Range], dict[tuple[str, int], tuple[int, int]],
                                           list[tuple[tuple[str, int], int]]]:
    """(ranges, launches, kernels) from a profiler's kineto events (`stop_profiler`).

    Two id spaces meet here: a host op's correlation id (our ranges; every op with
    `every_op`) is torch's, and a kernel's `linked_correlation_id` names the innermost
    recorded op at its launch; a CUDA runtime call's id is CUPTI's, and the kernel's own
    `correlation_id` is the call that launched it. Both count up from small numbers, so
    one dict keyed by the number let a runtime call overwrite a range with the same id
    and charge its kernels to another layer. Launches are keyed ("op", id) or
    ("runtime", id); a kernel is placed by its linked op when that op was recorded, else
    by its runtime call (whose time lies inside the range on the launching thread).
    `keep(name)`: only the GPU work whose name it accepts (e.g. `is_collective`)."""
    ranges, launches, gpu = [], {}, []
    for ev in events:
        device = str(ev.device_type())
        if device.endswith("CPU"):
            if ev.name().startswith(PREFIX):
                ranges.append(Range(ev.name(), ev.device_resource_id(), ev.start_ns(), ev.end_ns()))
            if ev.correlation_id():
                kind = "runtime" if is_runtime_call(ev) else "op"
                launches[(kind, ev.correlation_id())] = (ev.device_resource_id(), ev.start_ns())
        elif device.endswith("CUDA") and is_gpu_work(ev) and (keep is None or keep(ev.name())):
            gpu.append(ev)
    kernels = []
    for ev in gpu:
        linked = ("op", ev.linked_correlation_id())
        kernels.append((linked if linked in launches else ("runtime", ev.correlation_id()), ev.duration_ns()))
    return ranges, launches, kernels


class Coverage(NamedTuple):
    share: float        # of the window's kernel launches, those with a kernel record
    launches: int
    lost_at: list[int]  # the launches without one, by their order in the window (0: its first)


def kernel_coverage(events) -> Optional[Coverage]:
    """The share of the window's kernel launches (CUDA runtime or driver calls named
    *LaunchKernel*) that have a kernel record with their correlation id, and where the
    others sit; None where no launch was recorded. Under 1, CUPTI dropped records and the
    layers' kernel times are short by them, which nothing else would show (pytorch#192021:
    CUPTI 13.0, which torch's cu130 wheels bundle, loses kernels at a session's head after
    GPU idle time). A launch call made inside another on the same thread (a driver call
    under the runtime's, where both are recorded) is one launch with the outer one: either
    id's record counts for it."""
    calls: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    recorded = set()
    for ev in events:
        device = str(ev.device_type())
        if device.endswith("CPU") and ev.correlation_id() and LAUNCH.match(ev.name()):
            calls[ev.device_resource_id()].append((ev.start_ns(), ev.end_ns(), ev.correlation_id()))
        elif device.endswith("CUDA") and is_gpu_work(ev):
            recorded.add(ev.correlation_id())
    launches: list[tuple[int, set[int]]] = []  # (start, the ids of one launch)
    for items in calls.values():
        end = None
        for start_ns, end_ns, corr in sorted(items, key=lambda c: (c[0], -c[1])):
            if end is not None and end_ns <= end:  # inside the launch before it
                launches[-1][1].add(corr)
                continue
            launches.append((start_ns, {corr}))
            end = end_ns
    if not launches:
        return None
    lost = [i for i, (_, ids) in enumerate(sorted(launches, key=lambda x: x[0])) if not ids & recorded]
    return Coverage(1 - len(lost) / len(launches), len(launches), lost)


def is_collective(name: str) -> bool:
    """An NCCL kernel: on the GPU it runs until its peer arrives, so its duration holds
    the other rank's lateness (a pipeline bubble, a data-parallel straggler)."""
    return name.startswith("nccl")


def busy_by_range(events, collective_free: tuple[str, ...] = ()) -> dict[str, int]:
    """Kernel nanoseconds per range name; ranges whose span key is in `collective_free`
    leave out the NCCL kernels they hold directly (the step's rest: p2p and gradient
    reductions launched outside every layer wait on peers; a layer's tensor-parallel
    collectives stay its own)."""
    busy = attribute(*from_kineto(events))
    if collective_free:
        for name, ns in attribute(*from_kineto(events, keep=is_collective)).items():
            if parse_range(name)[1] in collective_free:
                busy[name] -= ns
    return busy


RUNTIME_ACTIVITIES = frozenset({"cuda_runtime", "cuda_driver"})
LAUNCH = re.compile(r"^cu(da)?LaunchKernel")  # cudaLaunchKernel(ExC), cuLaunchKernel(Ex)


def is_runtime_call(ev) -> bool:
    """A CUDA runtime or driver API call (CUPTI's id space), not a torch op. torch 2.11
    has no `activity_type`; the API's names do: cudaLaunchKernel, cuLaunchKernel, ..."""
    activity = getattr(ev, "activity_type", None)
    if activity is not None:
        return str(activity()).split(".")[-1] in RUNTIME_ACTIVITIES
    name = ev.name()
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


# Device-side records that are not GPU work: kineto mirrors every record_function range
# onto the GPU timeline ("gpu_user_annotation": the range's GPU extent, kernels and
# idle gaps both) and, when asked, the host's waits ("cuda_sync"). Counting them, as
# the first H200 run of 2026-11-27 did, charged each layer its kernels plus its own GPU
# extent (a frozen layer 5.9 ms against 2.7 ms of kernels; busy time above the span).
NOT_WORK = frozenset({"gpu_user_annotation", "user_annotation", "cuda_sync", "overhead"})


def is_gpu_work(ev) -> bool:
    """A kernel, memcpy or memset: what torch's own tables sum as device time. The
    accessors differ by torch version (2.11, on the lent GPUs, has no `activity_type`:
    the second H200 run lost every kernel time to an AttributeError), so each is read
    only where it exists, and a device record carrying one of our range names is our
    range's GPU mirror whatever else the version says."""
    if ev.name().startswith(PREFIX):
        return False
    annotation = getattr(ev, "is_user_annotation", None)
    if annotation is not None and annotation():
        return False
    activity = getattr(ev, "activity_type", None)
    return activity is None or str(activity()) not in NOT_WORK


TEARDOWN_ENV = "TEARDOWN_CUPTI"
TEARDOWN_MIN_CUDA = (12, 6)


def release_cupti_after_windows(cuda_version: Optional[str]) -> bool:
    """Ask kineto to detach CUPTI (cuptiFinalize) when each window's profiler stops (the
    module docstring): sets TEARDOWN_CUPTI=1 unless it is set already (the user's or
    torch's own choice stands) or CUDA is older than 12.6. Kineto reads it when a profiler
    stops, so it takes effect from the first window. Whether it was set by this call."""
    if TEARDOWN_ENV in os.environ or not cuda_version:
        return False
    try:
        version = tuple(int(x) for x in cuda_version.split(".")[:2])
    except ValueError:
        return False
    if version < TEARDOWN_MIN_CUDA:
        return False
    os.environ[TEARDOWN_ENV] = "1"
    logger.info("dynmo: %s=1: CUPTI is detached after each profiling window (else it slows "
                "every later iteration); set %s=0 to keep it attached", TEARDOWN_ENV, TEARDOWN_ENV)
    return True


def start_profiler(device: str, every_op: bool = False):
    """A started CUDA profiler (CPU activity too, for the launches and our ranges) that
    records only user-scope ranges on the host, i.e. ours, not every aten op.

    Why: with all scopes kineto records each host op (~170k events per CPU window of the
    test layer): on CPU that made a forward+backward 1.4-1.8x slower and closing the window
    took 1.6-5 s (`scripts/bench_profiler.py --scopes`); the H200 run measured 1.57x
    inside windows at the host-bound shape and 175-364 ms per close. Attribution needs only
    our ranges and the launches: a kernel's linked correlation id then names the innermost
    *recorded* op, which is our range, and the CUDA runtime's launch events come from
    CUPTI whatever the scopes. torch's public `profile` has no scope argument, so this
    drives `torch.autograd.profiler.profile` one step lower; if that private path is not
    there (another torch), the public profiler with every scope stands in, said once;
    `every_op` asks for that one (the benchmark's comparison)."""
    import torch
    from torch.autograd import profiler as autograd_profiler
    from torch._C._profiler import RecordScope
    if device == "cuda":
        release_cupti_after_windows(torch.version.cuda)
    prof = autograd_profiler.profile(use_device=device if device != "cpu" else None)
    try:
        if every_op:
            raise AttributeError("every host op asked for")
        prof._prepare_trace()
        autograd_profiler._run_on_profiler_start()
        autograd_profiler._enable_profiler(prof.config(), prof.kineto_activities, {RecordScope.USER_SCOPE})
        return prof
    except (AttributeError, TypeError, RuntimeError) as e:  # RuntimeError: refused by the C++ side
        logger.warning("dynmo: user-scope profiling unavailable (%s: %s); recording every host op",
                       type(e).__name__, e)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


def stop_profiler(prof) -> list:
    """Stop a profiler from `start_profiler` and return its kineto events."""
    if hasattr(prof, "kineto_activities"):
        prof.__exit__(None, None, None)
        return prof.kineto_results.events()
    prof.stop()
    return prof.profiler.kineto_results.events()


class KernelBusy:
    """The CUDA profiler over one profiling window (module docstring). `device` "cpu"
    runs the same profiler with host activity only (tests: ranges, no kernels)."""

    def __init__(self, enabled: bool, device: str = "cuda", every_op: bool = False,
                 collective_free: tuple[str, ...] = ()):
        self.enabled, self.collective_free = enabled, collective_free
        self.iteration = 0
        self.coverage: Optional[float] = None  # of the last stop (kernel_coverage)
        self._prof = None
        self._open: dict[tuple[str, int], object] = {}
        if enabled:
            try:  # another profiler already running (e.g. Megatron-LM's --profile) refuses a second
                self._prof = start_profiler(device, every_op)
            except Exception as e:  # noqa: BLE001 - the span clock still stands; say why once
                logger.warning("dynmo: GPU kernel times off in this window (%s: %s)", type(e).__name__, e)
                self._prof = None

    def open(self, key: str, mb: int) -> None:
        if self._prof is None:
            return
        from torch.autograd.profiler import record_function
        handle = record_function(range_name(self.iteration, key, mb))
        handle.__enter__()
        self._open[(key, mb)] = handle

    def close(self, key: str, mb: int) -> None:
        handle = self._open.pop((key, mb), None)
        if handle is not None:
            handle.__exit__(None, None, None)

    def next_iteration(self) -> None:
        self.iteration += 1

    def stop(self) -> Optional[dict[str, list[float]]]:
        """Seconds of kernels per span key, one sample per (iteration, micro-batch) in
        that order; None where nothing was collected (CPU, or the profiler failed)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()
        try:
            events = stop_profiler(prof)
            busy = busy_by_range(events, self.collective_free)
        except Exception as e:  # noqa: BLE001 - the span clock still stands; say why once
            logger.warning("dynmo: no GPU kernel times in this window (%s: %s)", type(e).__name__, e)
            return None
        try:  # a check of the records: its failure costs the check, never the kernel times
            coverage = kernel_coverage(events)
        except Exception as e:  # noqa: BLE001
            logger.warning("dynmo: kernel records not counted in this window (%s: %s)", type(e).__name__, e)
            coverage = None
        self.coverage = coverage.share if coverage is not None else None
        if coverage is not None and coverage.lost_at:
            logger.warning("dynmo: kernel records for %.2f%% of the window's kernel launches: CUPTI "
                           "dropped %d of %d (launches %s in the window's order), and the layers' "
                           "kernel times are short by them", 100 * coverage.share, len(coverage.lost_at),
                           coverage.launches, coverage.lost_at[:8])
        return samples_by_key(busy)


def samples_by_key(busy: dict[str, int]) -> dict[str, list[float]]:
    """Range name -> ns, regrouped as span key -> seconds per (iteration, micro-batch)."""
    keyed: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    for name, ns in busy.items():
        iteration, key, mb = parse_range(name)
        keyed[key].append((iteration, mb, ns / 1e9))
    return {key: [s for _, _, s in sorted(items)] for key, items in keyed.items()}
