"""A file baton: several training programs, each started once, take turns on one GPU.

Issue 34's throughput row compares programs (the launcher, Megatron-LM's pretrain_gpt.py,
pretrain_gpt.py --dynmo) over interleaved rounds. A round per launch paid a start-up
(24-32 s on the H200) per program per round; here each program starts once and its
training loop waits at round boundaries for the coordinator's go, so R rounds of P
programs cost P start-ups (at once) and R x P turns, and only one program's iterations
run on the GPU at any time.

A program trains `warmup + rounds * iters` iterations: round 0 is the warm-up (iterations
1..warmup), round r >= 1 iterations warmup+(r-1)*iters+1 .. warmup+r*iters. The files, in
one folder (`Baton`):
  ready-NAME         the program has built everything and waits before iteration 1
  go-NAME-R          the coordinator: NAME may run round R
  done-NAME-R        NAME finished round R (its GPU work synchronised): JSON {"start", "end"},
                     wall-clock seconds (time.time()) of the turn, for the record
The program side is `BatonClient.before/after(iteration)` around each iteration (the
launcher worker wraps its session's step, scripts/gpu_checks/mlm_program.py Megatron-LM's
train_step); the coordinator is `Baton.turns`.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

POLL_S = 0.002
ENV = "DYNMO_CHECK_BATON"  # a program's BatonSpec as JSON (torchrun programs)


@dataclass(frozen=True)
class BatonSpec:
    folder: str
    name: str
    warmup: int
    rounds: int
    iters: int
    alternate: int = 0  # the --dynmo program's on/off comparison: its profile interval (plugin_runs)

    @property
    def train_iters(self) -> int:
        return self.warmup + self.rounds * self.iters

    def round_of(self, iteration: int) -> tuple[int, bool, bool]:
        """(round, whether `iteration` is its first, whether its last); 1-based iterations."""
        if iteration <= self.warmup:
            return 0, iteration == 1, iteration == self.warmup
        r, k = divmod(iteration - self.warmup - 1, self.iters)
        return r + 1, k == 0, k == self.iters - 1

    def plugin_runs(self, iteration: int) -> bool:
        """Whether the plugin runs at `iteration` of this program. With `alternate` (the
        --dynmo program) it is bypassed on every other iteration after the warm-up, the
        odd ones in odd rounds and the even ones in even rounds, except multiples of
        `alternate` (its profiling windows): Megatron-LM's own train_step runs those, so
        the plugin's cost per step is timed on against off in ONE process (two processes
        of the same program differed by up to 25% on the H200), and in neighbouring pairs
        whose order flips from round to round, so a drift within a round or an effect of
        an iteration's parity does not read as the plugin's."""
        if not self.alternate or iteration <= self.warmup or iteration % self.alternate == 0:
            return True
        r, _, _ = self.round_of(iteration)
        return (iteration + r) % 2 == 1

    def first_iterations(self) -> set[int]:
        """The first iteration of every round: it follows a wait (one of the `edges`)."""
        return {1, *(self.warmup + (r - 1) * self.iters + 1 for r in range(1, self.rounds + 1))}

    def edges(self) -> set[int]:
        """The first and last iteration of every round, left out of every timing: the
        first follows the wait for the turn, the last holds the hand-over's GPU sync."""
        return self.first_iterations() | {self.warmup, *(self.warmup + r * self.iters for r in range(1, self.rounds + 1))}

    def iterations(self, r: int) -> range:
        if r == 0:
            return range(1, self.warmup + 1)
        return range(self.warmup + (r - 1) * self.iters + 1, self.warmup + r * self.iters + 1)

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "BatonSpec":
        return cls(**json.loads(text))


class BatonTimeout(RuntimeError):
    """No go (program side) or no done (coordinator side) within the time allowed."""


def _wait_for(path: Path, timeout_s: float, alive: Callable[[], Optional[str]] = lambda: None) -> None:
    """Until `path` exists; BatonTimeout after `timeout_s`, RuntimeError when `alive()`
    names why the other side is gone."""
    end = time.monotonic() + timeout_s
    while not path.exists():
        gone = alive()
        if gone:
            raise RuntimeError(gone)
        if time.monotonic() > end:
            raise BatonTimeout(f"no {path.name} after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def _until(timeout_s: float, deadline: float) -> float:
    """`timeout_s`, cut to what is left before `deadline` (time.monotonic())."""
    return max(0.0, min(timeout_s, deadline - time.monotonic()))


def _write(path: Path, text: str = "") -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # the other side never reads a half-written file


def _synchronize() -> None:
    """The program's GPU work is done before the next program's turn starts."""
    import sys
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class BatonClient:
    """The program side: `before(it)` waits for the go of the round `it` starts; `after(it)`
    says the round `it` ends is done. Iterations are 1-based."""

    def __init__(self, spec: BatonSpec, timeout_s: float = 900.0):
        self.spec, self.folder, self.timeout_s = spec, Path(spec.folder), timeout_s
        self.started: Optional[float] = None

    def before(self, iteration: int) -> None:
        r, first, _ = self.spec.round_of(iteration)
        if not first:
            return
        if r == 0:
            _write(self.folder / f"ready-{self.spec.name}")
        _wait_for(self.folder / f"go-{self.spec.name}-{r}", self.timeout_s)
        self.started = time.time()

    def after(self, iteration: int) -> None:
        r, _, last = self.spec.round_of(iteration)
        if last:
            _synchronize()
            _write(self.folder / f"done-{self.spec.name}-{r}",
                   json.dumps({"start": self.started, "end": time.time()}))


class Baton:
    """The coordinator: every program ready, then round by round each program's turn
    (the order rotates by one each round, so no program always follows the same one)."""

    def __init__(self, folder: Path, names: list[str], rounds: int):
        self.folder, self.names, self.rounds = folder, names, rounds
        folder.mkdir(parents=True, exist_ok=True)

    def order(self, r: int) -> list[str]:
        k = r % len(self.names)
        return self.names[k:] + self.names[:k]

    def wait_ready(self, timeout_s: float, alive: Callable[[], Optional[str]],
                   deadline: float = math.inf) -> None:
        """Every program ready within `timeout_s` in all (they start at once) and before
        `deadline` (time.monotonic())."""
        deadline = min(deadline, time.monotonic() + timeout_s)
        for name in self.names:
            _wait_for(self.folder / f"ready-{name}", _until(timeout_s, deadline), alive)

    def turns(self, turn_timeout_s: float, alive: Callable[[], Optional[str]],
              log: Callable[[str], None] = lambda _: None, deadline: float = math.inf) -> list[dict]:
        """Rounds 0..rounds (0: the warm-up), one program at a time, each turn within
        `turn_timeout_s` and all before `deadline` (time.monotonic()); the turns as the
        programs timed them: [{"round", "name", "start", "end"}] in order."""
        turns = []
        for r in range(self.rounds + 1):
            for name in self.order(r):
                _write(self.folder / f"go-{name}-{r}")
                done = self.folder / f"done-{name}-{r}"
                _wait_for(done, _until(turn_timeout_s, deadline), alive)
                turns.append({"round": r, "name": name, **json.loads(done.read_text())})
                log(f"round {r}: {name} {turns[-1]['end'] - turns[-1]['start']:.2f} s")
        (self.folder / "turns.json").write_text(json.dumps(turns))
        return turns


def overlaps(turns: list[dict]) -> list[tuple[str, str]]:
    """Pairs of turns whose wall-clock spans overlap (should be none)."""
    found, latest = [], None
    for t in sorted(turns, key=lambda t: t["start"]):
        if latest is not None and t["start"] < latest["end"]:
            found.append((f"{latest['name']}#{latest['round']}", f"{t['name']}#{t['round']}"))
        if latest is None or t["end"] > latest["end"]:
            latest = t
    return found
