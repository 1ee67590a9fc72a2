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


class _Log(RunReport):
    """RunReport, with the seconds spent rewriting the summary counted apart."""

    summary_s = 0.0

    def write(self, complete: bool = False) -> None:
        start = time.perf_counter()
        super().write(complete)
        self.summary_s += time.perf_counter() - start


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


def _fill(report: RunReport, first: int, last: int, every: int, layers: int) -> float:
    """Iterations first..last (events every `every`); seconds spent in the report calls."""
    spent = 0.0
    for it in range(first, last + 1):
        start = time.perf_counter()
        report.add_iteration(it, 10.0 - it * 1e-5, 0.2, dynmo_s=0.001, scenario_s=0.0)
        if it % every == 0:
            report.add_event(_event(it, layers))
        spent += time.perf_counter() - start
    return spent


def measure(kind: str, length: int, window: int, every: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cls = _Log if kind == "log" else _Rewrite
        report = cls(path=os.path.join(tmp, "report.json"), config={"model": {"num_layers": layers}},
                     world={"pp": 2, "history": []}, initial_layout="Ett|ttL")
        # the old writer's history is not timed (it would take hours at 64k): only its window
        report.enabled = kind == "log"
        before = _fill(report, 1, length - window, every, layers)
        summary_before = getattr(report, "summary_s", 0.0)
        report.enabled = True
        in_window = _fill(report, length - window + 1, length, every, layers)
        summary_window = getattr(report, "summary_s", 0.0) - summary_before
        start = time.perf_counter()
        report.close()
        final = time.perf_counter() - start
    periods = window / every
    out = {"writer": kind, "iterations": length, "window_s_per_event_period": in_window / periods,
           "final_write_s": final}
    if kind == "log":  # appends alone, and everything over the whole run
        out["append_s_per_event_period"] = (in_window - summary_window) / periods
        out["amortised_s_per_event_period"] = (before + in_window) / (length / every)
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
          f"period; window: the last {a.window} iterations; load avg {os.getloadavg()[0]:.2f}",
          file=sys.stderr)
    print("| iterations | log appends (window) | ratio | log amortised, summaries incl. | ratio "
          "| rewrite per event (window) | ratio | final summary s |")
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:
        lg, old = log_rows[n], old_rows[n]
        cells = [(lg["append_s_per_event_period"], log_rows[first]["append_s_per_event_period"]),
                 (lg["amortised_s_per_event_period"], log_rows[first]["amortised_s_per_event_period"]),
                 (old["window_s_per_event_period"], old_rows[first]["window_s_per_event_period"])]
        print(f"| {n} | " + " | ".join(f"{v * 1e3:.3f} | {v / b:.2f}x" for v, b in cells)
              + f" | {lg['final_write_s']:.3f} |")

if __name__ == "__main__":
    main()
