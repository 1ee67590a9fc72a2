"""The GPU check's launch plan as data (scripts/gpu_check.py builds it, docs/gpu.md
"Budget" prints it): every row group declares its launches, and each launch an estimate
from the constants below. An estimate, not a measurement: the constants come from the
first GPU runs (../shared/notes/h200-measured.md, h100-measured.md) where they were
measured, and say so where they were not; every row of a real run prints its seconds,
which is how the next GPU run corrects them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

BUDGET_S = 480.0  # issue 24: the whole GPU check in at most 8 minutes on one H100/H200
START_GROUP = "start"  # the group that starts the probe, the launcher worker, the NCCL children

# Start-up of one launch, seconds, by kind. Re-fitted to the first device_check.sh run
# on one H200 (../shared/notes/h200-acceptance-1.md, 2026-11-27); the run re-estimates
# the groups still to come from what the finished ones took (`Schedule`).
# Groups that a device call of their own runs (`--only scenario_cost,bf16_vs_fp32_speed`):
# with start-up measured on the H200 (2026-11-27: a launcher-worker run 26-42 s, not
# 6-14) every row does not fit one 9-minute call beside megatron_lm_gpu_check.sh. Issue 34's
# rows (`--set issue34`, the interleaved throughput session among them) go first; issue 33's
# scenario rows (resolved) and the speed row go to a second call.
SECOND_CALL = ("scenario_cost", "bf16_vs_fp32_speed")

START_S = {
    # h200-acceptance-1: a pretrain_gpt.py torchrun launch ~32 s of start-up (was 40 s)
    "torchrun": 32.0,
    # a plain Python child doing the same imports and CUDA start without torchrun's agent;
    # with NCCL_LONGEST_ROW_S the start group measured ~33 s (the plan said 55 s)
    "process": 20.0,
    # one more run in the started launcher worker (scripts/gpu_check_worker.py): its process
    # group, model, optimizer and first-iteration warm-up. h200-acceptance-1: 10-19 s each
    # (was 6 s, not measured then). The H200 run of 2026-11-27: 26.5-31.5 s per run of
    # 8-12 iterations (the plan's 14 s made every later estimate x1.6-1.7 and skipped the
    # last two scenario rows): start-up ~24 s
    "worker": 24.0,
    # gpu_check.py itself: imports torch and megatron-core to probe the machine
    "parent": 10.0,
}

# GPU work of one training iteration, seconds, by model (bf16 unless named).
IT_S = {
    # h200: the launcher at 12L h1024 s1024 mb4 gbs16, median 173-187 ms/iteration
    "host": 0.19,
    # the same with the 3x test layer: 14 layers' work instead of 12
    "host_heavy": 0.19 * 14 / 12,
    # h200: pretrain_gpt.py at the same model, 200-249 ms/iteration
    "mlm_host": 0.25,
    # h100: a h4096 s2048 mb1 layer's fwd+bwd 4.8 ms; 6 layers + 2 repeats of the 3x layer
    # + the output layer (~3 layers) = ~53 ms per micro-batch, x4, + Adam over 1.35e9 params
    "gpu_heavy": 0.30,
    "mlm_gpu": 0.25,
    # the scenario rows' GPU-bound shape, 8L h4096 s4096 mb2 (sdpa) x 2 micro-batches:
    # ~11 ms of kernels per layer (twice the tokens of h4096 s2048 mb1's 7.3 ms, less the
    # unfused attention; estimated) x 16 + output layer and Adam over ~1.7e9 parameters
    "s8": 0.35,
    # MoD's row at micro-batch 4 (host-bound at mb2: docs/scenarios/mixture_of_depths.md):
    # twice s8's tokens per micro-batch; estimated
    "s8_mb4": 0.65,
    # estimated: layers 1-4 hold 8 experts of FFN 4096, top-2 at capacity <= 1: about the
    # dense iteration plus routing and dispatch
    "s8_moe": 0.45,
    # h1024 at sequence 32768, mb1 x 2 (the sparse-attention row since issue 33's second
    # pass: host-bound at s16384): a dense causal SDPA layer 17.27 ms of kernels (H200,
    # layer_probe lsh1) x 16 + the 32k-vocabulary head over 32768 tokens; estimated
    "sparse_s32768": 0.35,
    # h200: fp32 23,709 tokens/s and bf16 110,358 tokens/s at 16,384 tokens per iteration
    "speed_fp32": 0.69,
    "speed_bf16": 0.15,
    # small models (TE check, CPU dry run): start-up dominates
    "small": 0.10,
}

# The NCCL rows' children run at once: the plan counts one start-up and the longest
# child's own work (a collective on a destroyed group waits 20 s; the others train a
# 4-layer h64 model for 2-4 steps). Estimated, not measured.
NCCL_LONGEST_ROW_S = 13.0  # h200-acceptance-1: the start group ~33 s in all
# the interleaved session's hand-over between two programs' turns (gpu_checks/baton.py):
# a file written and polled every 2 ms, a CUDA synchronisation; estimated, not measured
BATON_TURN_S = 0.1
# sparse attention's calibration at its start (h200-acceptance-1: its run took 27 s
# where the plan said 8 s): seconds the plan adds to that run
SPARSE_CALIBRATION_S = 20.0


@dataclass(frozen=True)
class Launch:
    what: str
    kind: str               # a key of START_S
    iters: int = 0
    it_s: float = 0.0       # work per iteration, a value of IT_S
    extra_s: float = 0.0    # work not in iterations
    # the rows (name prefixes) it feeds, where not all its group's (the start group's
    # launches: --only may pick some of its rows); () = every row of the group
    feeds: tuple[str, ...] = ()
    starts_worker: bool = False  # the launcher worker's start: needed by any worker run
    # programs started at the same time as this one (kinds of START_S), their start-ups
    # overlapping its own (only the launch's START_S counts: give it the longest)
    alongside: tuple[str, ...] = ()

    def estimate_s(self) -> float:
        return START_S[self.kind] + self.iters * self.it_s + self.extra_s

    @property
    def needs_worker(self) -> bool:
        return "worker" in (self.kind, *self.alongside)


@dataclass(frozen=True)
class Group:
    """Rows fed by the same launches (one run may feed several rows)."""

    name: str
    rows: tuple[str, ...]
    launches: tuple[Launch, ...] = ()
    parallel: bool = False  # the launches run at the same time: the longest counts
    note: str = ""          # why it has no launch here (e.g. "skipped: needs 2 GPUs")

    def estimate_s(self) -> float:
        costs = [x.estimate_s() for x in self.launches]
        return (max(costs, default=0.0) if self.parallel else sum(costs))

    def selected(self, only: tuple[str, ...]) -> bool:
        """Whether --only (row or group name prefixes) picks any of its rows."""
        return not only or self.name.startswith(only) or any(r.startswith(only) for r in self.rows)

    def selected_rows(self, only: tuple[str, ...]) -> list[str]:
        if not only or self.name.startswith(only):
            return list(self.rows)
        return [r for r in self.rows if r.startswith(only)]

    def trimmed(self, only: tuple[str, ...], worker: bool) -> Optional["Group"]:
        """The group with only the launches that feed a row --only picks (and the
        worker's start where a chosen run needs it); None when nothing is left to run."""
        rows = self.selected_rows(only)
        keep = tuple(x for x in self.launches if (x.starts_worker and worker) or (
            not x.starts_worker and (not x.feeds or any(r.startswith(x.feeds) for r in rows))))
        if not rows and not keep:
            return None
        if keep == self.launches and len(rows) == len(self.rows):
            return self
        return replace(self, rows=tuple(rows), launches=keep)


@dataclass
class Plan:
    groups: list[Group]
    budget_s: float = BUDGET_S
    assumes: str = ""
    only: tuple[str, ...] = field(default=())

    def chosen(self) -> list[Group]:
        """The groups --only picks, each trimmed to the launches that feed its picked rows,
        and the launcher worker's start wherever a picked group runs in the worker (the
        start group then counts it even when none of its own rows is picked)."""
        picked = [g for g in self.groups if g.rows and g.selected(self.only)]
        worker = any(x.needs_worker for g in picked for x in g.launches)
        groups = []
        for g in self.groups:
            if g in picked or any(x.starts_worker for x in g.launches):
                kept = g.trimmed(self.only if g in picked else ("\0",), worker)
                if kept is not None:
                    groups.append(kept)
        return groups

    def total_s(self) -> float:
        return sum(g.estimate_s() for g in self.chosen())

    def rows(self) -> list[str]:
        return [r for g in self.groups for r in g.rows]

    def to_dict(self) -> dict:
        return {"assumes": self.assumes, "budget_s": self.budget_s, "total_s": round(self.total_s(), 1),
                "constants": {"start_s": START_S, "iteration_s": IT_S},
                "groups": [{"group": g.name, "rows": list(g.rows), "launches": len(g.launches),
                            "estimate_s": round(g.estimate_s(), 1), "note": g.note,
                            "what": [x.what for x in g.launches]} for g in self.chosen()]}


def render_plan(plan: Plan) -> str:
    """The plan as a table: group, rows, launches (by kind), estimated seconds."""
    groups = plan.chosen()
    width = max([len(g.name) for g in groups] + [len("row group")])
    lines = [f"launch plan ({plan.assumes}); estimates from documented constants, not timings",
             f"{'row group':<{width}} | {'launches':<32} | est. s | rows",
             f"{'-' * width}-+-{'-' * 32}-+--------+-----"]
    for g in groups:
        kinds: dict[str, int] = {}
        for x in g.launches:
            for kind in (x.kind, *x.alongside):
                kinds[kind] = kinds.get(kind, 0) + 1
        launches = ", ".join(f"{n} {k}" for k, n in kinds.items()) + (
            " (parallel)" if g.parallel else " (at once)" if any(x.alongside for x in g.launches) else "")
        rows = ", ".join(g.rows) if len(g.rows) <= 3 else f"{g.rows[0]} ... ({len(g.rows)} rows)"
        rows = rows or "(the launcher worker's start, for the groups below)"
        lines.append(f"{g.name:<{width}} | {launches or g.note or '-':<32} | {g.estimate_s():>6.0f} | "
                     f"{rows}")
    total = plan.total_s()
    lines.append(f"total: {total:.0f} s estimated of a {plan.budget_s:.0f} s budget"
                 + ("" if total <= plan.budget_s else " -- OVER BUDGET: the run moves a group that does not fit behind cheaper ones; "
                    "what still does not fit says 'skipped: budget'"))
    return "\n".join(lines)


class Schedule:
    """The order the groups run in, re-estimated as the run goes (issue 34).

    Every estimate is scaled by what the finished groups took over what they were
    estimated (`scale`, clamped to 0.5-2: one odd group does not swing it far). A group
    whose scaled estimate no longer fits what is left is moved behind the cheaper groups
    still to come (once), rather than skipped while they could run; met again and still
    too long, it is skipped. A group without launches always runs (it costs nothing)."""

    def __init__(self, groups: list[Group]):
        self.pending = list(groups)
        self.deferred: set[str] = set()
        self.estimated = self.actual = 0.0
        self.carried = (0.0, 0.0)  # the start group's (estimate, seconds), for the next group

    @property
    def scale(self) -> float:
        if self.estimated <= 0:
            return 1.0
        return min(2.0, max(0.5, self.actual / self.estimated))

    def estimate_s(self, group: Group) -> float:
        return group.estimate_s() * self.scale

    def next(self, left_s: float) -> Optional[tuple[Group, bool]]:
        """(the next group, whether to run it: False = skip it for the budget); None at the end."""
        while self.pending:
            group = self.pending[0]
            need = self.estimate_s(group)
            if not group.launches or need <= left_s:
                return self.pending.pop(0), True
            cheaper = [g for g in self.pending[1:] if self.estimate_s(g) < need]
            if cheaper and group.name not in self.deferred:
                self.deferred.add(group.name)
                self.pending.append(self.pending.pop(0))
                continue
            return self.pending.pop(0), False
        return None

    def done(self, group: Group, seconds: float) -> None:
        """A group ran in `seconds`: the later estimates follow. The start group only
        starts processes (the launcher worker's start-up is paid inside the first run in
        it; gpu_check.py's imports, `parent`, before the budget's clock): its estimate
        less the imports is weighed with the next group's seconds, not its own ~0 s,
        which alone would halve every later estimate (the 0.5 clamp)."""
        if not group.launches:
            return
        if group.name == START_GROUP:
            rest = [x.estimate_s() for x in group.launches if x.kind != "parent"]
            estimate = (max(rest, default=0.0) if group.parallel else sum(rest))
            self.carried = (self.carried[0] + estimate, self.carried[1] + seconds)
            return
        (estimate, taken), self.carried = self.carried, (0.0, 0.0)
        self.estimated += group.estimate_s() + estimate
        self.actual += seconds + taken
