#!/usr/bin/env python
"""Report writing cost as a run grows: the log + summary (RunReport) vs. the old way
(report.json rewritten whole after every event), side by side in one run.

A synthetic run (no training): one iteration record per iteration, one rebalance event
with a per-layer profile every --event-every iterations. For each run length L, times
the report calls of the LAST --window iterations (what a run pays at that point) and,
for the log, also the whole run amortised (summary rewrites included). Prints the cost
per event period and its ratio to the shortest run: flat for the log, growing with L
for the rewrite. Single process, CPU only.
Usage: python scripts/bench_report.py [--lengths 1000,4000,16000,64000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from dynmo_plugin.report import RunReport


def _event(it: int, layers: int) -> dict:
    profile = {"layers": [{"layer": n, "stage": n * 2 // layers, "fwd_s": 1e-3 * n, "bwd_s": 2e-3 * n,
                           "param_bytes": 1 << 20, "grad_bytes": 1 << 20, "optim_bytes": 2 << 20,
                           "act_bytes": 1 << 18} for n in range(1, layers + 1)]}
    return {"iteration": it, "kind": "rebalance", "trigger": "interval", "applied": False,
            "layout_before": "Ett|ttL", "layout_after": "Ett|ttL", "moves": [],
            "overhead_s": {"profiling": 0.01, "decision": 0.001}, "profile": profile}


class _Rewrite(RunReport):
    """The old writer (before the log): nothing appended, the whole report.json
    rewritten on every event, by json.dump with indent=1."""

    def _open(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def _append(self, obj: dict) -> None:
        if self.enabled and obj["kind"] == "event":
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(self.to_dict(), fh, indent=1)
            os.replace(tmp, self.path)


def _fill(report: RunReport, first: int, last: int, every: int, layers: int) -> list[float]:
    """Iterations first..last (events every `every`); seconds spent in the report calls
    per event period (the iterations up to and including an event)."""
    periods, spent = [], 0.0
    for it in range(first, last + 1):
        start = time.perf_counter()
        report.add_iteration(it, 10.0 - it * 1e-5, 0.2, dynmo_s=0.001, scenario_s=0.0)
        if it % every == 0:
            report.add_event(_event(it, layers))
        spent += time.perf_counter() - start
        if it % every == 0:
            periods.append(spent)
            spent = 0.0
    return periods


def measure(kind: str, length: int, window: int, every: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cls = RunReport if kind == "log" else _Rewrite
        report = cls(path=os.path.join(tmp, "report.json"), config={"model": {"num_layers": layers}},
                     world={"pp": 2, "history": []}, initial_layout="Ett|ttL")
        # the old writer's history is not timed (it would take hours at 64k): only its window
        report.enabled = kind == "log"
        before = _fill(report, 1, length - window, every, layers)
        report.enabled = True
        in_window = _fill(report, length - window + 1, length, every, layers)
        start = time.perf_counter()
        report.close()
        final = time.perf_counter() - start
    out = {"writer": kind, "iterations": length, "final_write_s": final,
           # the median event period of the window: a period that rewrote the log's summary
           # (one in many) is left out here, counted in the amortised figure
           "window_s_per_event_period": statistics.median(in_window)}
    if kind == "log":
        out["amortised_s_per_event_period"] = (sum(before) + sum(in_window)) / (length / every)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1000,4000,16000,64000",
                   help="run lengths in iterations (comma-separated, each > --window)")
    p.add_argument("--window", type=int, default=200, help="iterations timed at the end of each run")
    p.add_argument("--event-every", type=int, default=20, help="an event every N iterations")
    p.add_argument("--layers", type=int, default=32, help="layers in each event's profile")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if min(lengths) <= a.window:
        p.error(f"every run length must exceed --window ({a.window}); got {min(lengths)}")
    rows = [measure(kind, n, a.window, a.event_every, a.layers) for n in lengths
            for kind in ("log", "rewrite")]
    if a.json:
        print(json.dumps({"load_avg_1m": os.getloadavg()[0], "rows": rows}))
        return
    log_rows = {r["iterations"]: r for r in rows if r["writer"] == "log"}
    old_rows = {r["iterations"]: r for r in rows if r["writer"] == "rewrite"}
    first = lengths[0]
    print(f"# event every {a.event_every} iterations ({a.layers}-layer profile); ms per event "
          f"period; window: median period of the last {a.window} iterations; load avg "
          f"{os.getloadavg()[0]:.2f}", file=sys.stderr)
    print("| iterations | log (window) | ratio | log amortised over the run | ratio "
          "| old rewrite (window) | ratio | final summary s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:
        lg, old = log_rows[n], old_rows[n]
        cells = [(lg["window_s_per_event_period"], log_rows[first]["window_s_per_event_period"]),
                 (lg["amortised_s_per_event_period"], log_rows[first]["amortised_s_per_event_period"]),
                 (old["window_s_per_event_period"], old_rows[first]["window_s_per_event_period"])]
        print(f"| {n} | " + " | ".join(f"{v * 1e3:.3f} | {v / b:.2f}x" for v, b in cells)
              + f" | {lg['final_write_s']:.3f} |")

if __name__ == "__main__":
    main()
