"""How often the throughput row's plugin-overhead verdict decides, and how often wrongly.

`rows_mlm.overhead_verdict` judges the plugin's on/off <= 1.03 from the signed-rank
interval over the --dynmo program's neighbouring pairs (gpu_checks/paired.py); the rule
before it judged the 4 rounds' medians (every round over fails, every round under passes,
rounds on both sides by their median where they spread under 3%). This prints, for
simulated sessions, the share of pass / not judged / fail of both, by the per-iteration
variation (lognormal sigma), the number of pairs and the true overhead, so a GPU run's
"not judged" can be read as what its noise allowed; and, under a drift within a round or
an effect of an iteration's parity, the pairs' verdict with the plugin always first in
its pair against first and second by turns. Fixed seeds: the same tables each run.

    python scripts/overhead_power.py [--trials 1000] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks.rows_mlm import overhead_verdict  # noqa: E402
from gpu_checks.rows_shapes import PLUGIN_OVERHEAD_MAX  # noqa: E402

ROUNDS = 4
STALL = (1 / 40, 1.3)  # one iteration in 40 stalls 30% (a GC pass, a page-in): either side
SIGMAS = (0.02, 0.035, 0.05)
TRUE = (1.00, 1.02, 1.03, 1.04, 1.05, 1.06, 1.08)


def rounds_rule(medians: list[float]) -> str:
    """The verdict before 2026-11-29, by the rounds' on/off medians (for comparison only)."""
    bound = PLUGIN_OVERHEAD_MAX
    if min(medians) > bound:
        return "fail"
    if max(medians) <= bound:
        return "pass"
    if max(medians) - min(medians) < bound - 1:
        return "pass" if statistics.median(medians) <= bound else "fail"
    return "not judged"


def pairs_rule(pairs: list[float]) -> str:
    passed, how = overhead_verdict(pairs)
    return "not judged" if "not judged" in how else "pass" if passed else "fail"


def _noise(rng: random.Random, sigma: float) -> float:
    """One iteration's factor: lognormal, and now and then a stall (STALL)."""
    stall = STALL[1] if rng.random() < STALL[0] else 1.0
    return math.exp(rng.gauss(0.0, sigma)) * stall


def session(rng: random.Random, sigma: float, true: float, per_round: int) -> tuple[list[float], list[float]]:
    """(the rounds' on/off medians, every pair's on/off): each round at its own level (it
    cancels in a ratio), each iteration lognormal around it, the plugin's side x `true`."""
    def step(level: float, factor: float) -> float:
        return level * factor * _noise(rng, sigma)
    medians, pairs = [], []
    for _ in range(ROUNDS):
        level = math.exp(rng.gauss(0.0, 0.05))
        on = [step(level, true) for _ in range(per_round)]
        off = [step(level, 1.0) for _ in range(per_round)]
        medians.append(statistics.median(on) / statistics.median(off))
        pairs += [a / b for a, b in zip(on, off)]
    return medians, pairs


def ordered_session(rng: random.Random, sigma: float, true: float, per_round: int, effect: tuple[str, float],
                    flip: bool) -> list[float]:
    """Every pair's on/off where iterations carry an order effect besides their noise:
    ("drift", d) scales a round's k-th iteration by 1 + d k, ("parity", e) by 1 + e on
    even and 1 - e on odd ones. Pair p is the round's iterations 2p and 2p + 1, the
    plugin on the first, or (`flip`) on the second in every other round (as
    BatonSpec.plugin_runs does)."""
    kind, size = effect
    pairs = []
    for r in range(ROUNDS):
        times = []
        for k in range(2 * per_round):
            order = 1 + size * k if kind == "drift" else 1 + size * (1 if k % 2 == 0 else -1)
            times.append(order * _noise(rng, sigma))
        second = flip and r % 2 == 1
        for p in range(per_round):
            on, off = (times[2 * p + 1], times[2 * p]) if second else (times[2 * p], times[2 * p + 1])
            pairs.append(true * on / off)
    return pairs


def order_table(trials: int) -> list[dict]:
    """The pairs' verdict under order effects, the plugin always first against flipped."""
    rng = random.Random(35)
    rows = []
    for effect in (("none", 0.0), ("drift", -0.003), ("parity", 0.005)):
        for true in (1.00, 1.03):
            for flip in (False, True):
                said = [pairs_rule(ordered_session(rng, 0.02, true, 7, effect, flip)) for _ in range(trials)]
                rows.append({"effect": f"{effect[0]} {effect[1]:+g}" if effect[1] else "none", "true": true,
                             "flip": flip, **{k: said.count(k) / trials for k in ("pass", "not judged", "fail")}})
    return rows


def table(trials: int) -> list[dict]:
    rng = random.Random(34)
    rows = []
    for per_round in (4, 7):
        for sigma in SIGMAS:
            for true in TRUE:
                runs = [session(rng, sigma, true, per_round) for _ in range(trials)]
                row = {"n_pairs": ROUNDS * per_round, "sigma": sigma, "true": true}
                for name, rule, pick in (("rounds", rounds_rule, 0), ("pairs", pairs_rule, 1)):
                    said = [rule(r[pick]) for r in runs]
                    row[name] = {k: said.count(k) / trials for k in ("pass", "not judged", "fail")}
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args(argv)
    if args.trials < 1:
        print("overhead_power.py: --trials must be at least 1 (e.g. --trials 1000)", file=sys.stderr)
        return 2
    rows, order = table(args.trials), order_table(args.trials)
    if args.json:
        print(json.dumps({"table": rows, "order": order}))
        return 0
    print(f"share pass / not judged / fail of {args.trials} simulated sessions ({ROUNDS} rounds); "
          f"bound {PLUGIN_OVERHEAD_MAX}; 'rounds': the rounds' medians (before), 'pairs': the interval")
    print(f"{'pairs':>5} {'sigma':>6} {'true':>5} | {'rounds':^17} | {'pairs':^17}")
    for r in rows:
        cells = [" ".join(f"{100 * r[k][v]:5.0f}" for v in ("pass", "not judged", "fail")) for k in ("rounds", "pairs")]
        print(f"{r['n_pairs']:5d} {r['sigma']:6.3f} {r['true']:5.2f} | {cells[0]} | {cells[1]}")
    print("\norder effects, 28 pairs, sigma 0.02: the pairs' share pass / not judged / fail, the plugin "
          "always first in its pair against first and second by turns (BatonSpec.plugin_runs)")
    print(f"{'effect':>14} {'true':>5} | {'always first':^17} | {'by turns':^17}")
    for a, b in zip(order[::2], order[1::2]):
        cells = [" ".join(f"{100 * x[v]:5.0f}" for v in ("pass", "not judged", "fail")) for x in (a, b)]
        print(f"{a['effect']:>14} {a['true']:5.2f} | {cells[0]} | {cells[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
