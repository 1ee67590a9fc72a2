#!/usr/bin/env python
"""Data-side balancing on this machine: sequential packing vs WLB-LLM packing (with and
without outlier queues) vs + DP redistribution, on PP=2 and on PP=1 x DP=2.

Same documents for every packer: lognormal lengths, and a real corpus made on the fly
from the Python standard library's sources (scripts/prepare_data.py, byte tokenizer,
one document per block between blank-line runs). For each (documents, layout, packer):

* predicted micro-batch cost max/mean: the KnapFormer model fitted below, over the
  planned micro-batches of the timed iterations (mean of per-iteration max/mean);
* measured micro-batch cost max/mean: decoder layers' forward + backward CPU thread
  time per micro-batch, from the profiler (StageProbe) in one process, over the first
  iterations' micro-batches; the same samples fit the cost models (even micro-batches)
  and give their held-out error (odd ones) against a token-count model;
* wall clock: `dynmo-train` under torchrun (2 ranks, one per core), runs interleaved
  over rounds; tokens/s = real (non-padding) tokens of the timed iterations over their
  time, median over rounds; speedup = tokens/s over sequential packing's; iteration
  time ratio likewise; packing_share = planning time per iteration / iteration time;
* documents_complete: no document trained twice and every document drawn from the
  stream either trained or still waiting (carried over or in an outlier queue).

    python scripts/bench_data_balance.py [--json] [--rounds N] [--iters N] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import ROOT, free_port, print_result, read_result, torchrun  # noqa: E402

from dynmo_plugin.config import DataConfig  # noqa: E402
from dynmo_plugin.megatron.data.build import build_packed_documents  # noqa: E402

PACKERS = {"sequential": dict(packer="sequential"), "wlb": dict(packer="wlb"),
           "wlb+outlier": dict(packer="wlb", outlier="yes"),
           "wlb+redistribute": dict(packer="wlb", outlier="yes", redistribute=True)}
LAYOUTS = {"pp2": dict(pp=2, dp=1), "dp2": dict(pp=1, dp=2)}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def outlier_levels(seq: int) -> str:
    """Three outlier levels, Lmax/4, Lmax/2, 3 Lmax/4: releases of one level are close in
    length (scripts/bench_data_balance.py --levels-sweep measures the alternatives)."""
    return f"{seq // 4},{seq // 2},{3 * seq // 4}"


def data_config(source: dict, packer: str, seq: int, levels: str | None = None,
                delay: int = 8) -> DataConfig:
    p = PACKERS[packer]
    return DataConfig(path=source.get("path", ""), documents=source.get("documents", "none"),
                      lognormal_median=source.get("median", 256.0), packer=p["packer"],
                      outlier_thresholds=(levels or outlier_levels(seq)) if p.get("outlier") else "",
                      outlier_max_delay=delay, redistribute=p.get("redistribute", False),
                      cost_model="knapformer")


def variants(sources: dict):
    for sname in sources:
        for layout in LAYOUTS:
            for packer in PACKERS:
                if packer == "wlb+redistribute" and layout != "dp2":
                    continue
                yield sname, layout, packer


def stream_for(a, source: dict, layout: str, packer: str, levels: str | None = None,
               delay: int = 8):
    dp = LAYOUTS[layout]["dp"]
    return build_packed_documents(data_config(source, packer, a.seq, levels, delay), a.seed, 256,
                                  a.seq, dp, a.global_batch // dp)


# ---- the profiler pass (one process, under torchrun: Megatron's groups) ---------------------
def measure_worker(a) -> None:
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.data.cost_model import (fit_adaptiveload, fit_knapformer, fit_tokens,
                                              held_out_error, samples_from_probe)
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.profiling.probe import StageProbe
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    from dynmo_plugin.megatron.attention.varlen import packed_seq_params
    from dynmo_plugin.profiling.clock import CpuThreadClock

    sources = json.loads(a.sources)
    args = ModelArgs(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4,
                     seq_length=a.seq, micro_batch_size=1, global_batch_size=a.global_batch,
                     vocab_size=384, seed=a.seed, data=DataConfig(documents="lognormal"))
    trainer = StageTrainer(args, init_parallel(args), Layout.uniform(a.layers, 1))
    model = trainer.model
    numbers = [layer.layer_number for layer in model.decoder.layers]
    measured, samples = {}, []
    for sname, layout, packer in variants(sources):
        stream = stream_for(a, sources[sname], layout, packer)
        probe = StageProbe(model, CpuThreadClock(), count_activations=False)
        probe.attach()
        lengths, ratios = [], []
        for it in range(1, a.measure_iters + 1):
            plan = stream.plan(it)
            mbs = [[plan.pieces[s] for s in ids] for mb in plan.groups for ids in mb]
            for pieces in mbs:
                batch = stream.build(pieces)
                out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                            packed_seq_params=packed_seq_params(batch))
                ((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum().clamp(min=1)).backward()
                model.zero_grad(set_to_none=True)
                lengths.append([p.length for p in pieces])
            probe.end_iteration()
            n = len(mbs)
            per_mb = [sum(probe.samples[f"{k}/{x}"][-n:][i] for x in numbers for k in ("fwd", "bwd"))
                      for i in range(n)]
            ratios.append(max(per_mb) / float(np.mean(per_mb)))
        probe.detach()
        measured[f"{sname}/{layout}/{packer}"] = float(np.mean(ratios))
        for x in numbers:
            samples += samples_from_probe(probe.samples, x, lengths, a.seq)
    fit_set, held = samples[0::2], samples[1::2]
    kf, al, tk = fit_knapformer(fit_set, a.hidden), fit_adaptiveload(fit_set), fit_tokens(fit_set)
    print_result({"measured": measured, "knapformer": {"k": kf.k, "gamma": kf.gamma},
                  "adaptiveload": {"a": al.a, "b": al.b, "p": al.p, "r2": al.r2},
                  "held_out_error": {"knapformer": held_out_error(kf, held),
                                     "adaptiveload": held_out_error(al, held),
                                     "tokens": held_out_error(tk, held)},
                  "samples": len(samples)})
    destroy_parallel()


# ---- planning (in this process) and wall-clock runs -------------------------------------------
def plan_stats(a, source: dict, layout: str, packer: str, kf, iters: int | None = None,
               levels: str | None = None, delay: int = 8) -> dict:
    """The planned iterations under the bench's fitted model `kf` (from the start; a run
    fits its own at iterations 1-2, which with fixed-shape rows orders documents alike:
    KnapFormer's document workload is alpha l^2). `lower_bound`: per iteration, max(the
    row holding only its heaviest document, the mean row) / mean row: no packer of these
    documents into these rows does better."""
    stream = stream_for(a, source, layout, packer, levels, delay)
    stream.set_cost_model(kf)
    trained, pulled, tokens, packing, ratios, bounds = [], [], [], [], [], []
    for it in range(1, (iters or a.iters) + 1):
        plan = stream.plan(it)
        trained += [s for mb in plan.groups for ids in mb for s in ids]
        pulled += plan.pulled
        tokens.append(sum(sum(x) for mb in plan.lengths for x in mb))
        packing.append(plan.packing_s)
        cost = [a.layers * kf.predict(x, a.seq) for mb in plan.lengths for x in mb]
        longest = max(n for mb in plan.lengths for x in mb for n in x)
        if it > a.warmup:
            mean = float(np.mean(cost))
            ratios.append(max(cost) / mean)
            bounds.append(max(a.layers * kf.predict([longest], a.seq), mean) / mean)
    waiting = set(plan.leftover) | set(plan.queued)
    complete = len(trained) == len(set(trained)) and set(trained) | waiting == set(pulled)
    return {"tokens": tokens, "packing_s": float(np.mean(packing)),
            "predicted": float(np.mean(ratios)), "lower_bound": float(np.mean(bounds)),
            "documents_complete": complete, "trained": len(trained), "waiting": len(waiting)}


def run_once(a, source: dict, layout: str, packer: str, out: Path) -> list[float]:
    shape = LAYOUTS[layout]
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", "4", "--seq-length", str(a.seq), "--micro-batch-size", "1",
             "--global-batch-size", str(a.global_batch), "--train-iters", str(a.iters),
             "--pipeline-model-parallel-size", str(shape["pp"]), "--seed", str(a.seed),
             "--log-interval", str(a.iters)]
    d = data_config(source, packer, a.seq)
    flags += (["--data-path", d.path] if d.path else
              ["--data-documents", d.documents, "--data-lognormal-median", str(d.lognormal_median)])
    flags += ["--data-packer", d.packer, "--data-cost-model", d.cost_model, "--output", str(out)]
    if d.outlier_thresholds:
        flags += ["--data-outlier-thresholds", d.outlier_thresholds]
    if d.redistribute:
        flags += ["--data-redistribute"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "dynmo_plugin.train", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    report = json.loads((out / "report.json").read_text())
    fits = [e for e in report["events"] if e.get("kind") == "data_cost_fit"]
    return [it["time_s"] for it in report["iterations"]], (fits[0] if fits else None)


def make_corpus(tmp: Path) -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for d in ("json", "email", "asyncio") for p in (lib / d).glob("*.py"))
    prefix = str(tmp / "stdlib")
    subprocess.run([sys.executable, str(ROOT / "scripts/prepare_data.py"), "--input", *files,
                    "--output-prefix", prefix, "--split", "blank-lines", "--json"],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    return prefix


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of wall-clock runs")
    ap.add_argument("--iters", type=int, default=8, help="iterations per run")
    ap.add_argument("--warmup", type=int, default=2, help="iterations not timed")
    ap.add_argument("--measure-iters", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="Lmax: positions per micro-batch")
    ap.add_argument("--global-batch", type=int, default=8, help="micro-batches per iteration")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--median", type=float, default=128.0, help="lognormal median length")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--quick", action="store_true", help="1 round, 5 iterations, no corpus")
    ap.add_argument("--measure-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sources", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.measure_worker:
        measure_worker(a)
        return 0
    if a.quick:
        a.rounds, a.iters, a.warmup = 1, 5, 1
    with tempfile.TemporaryDirectory() as tmp:
        return bench(a, Path(tmp))


def bench(a, tmp: Path) -> int:
    from dynmo_plugin.data.cost_model import KnapFormerCost
    load0 = os.getloadavg()[0]
    sources = {"lognormal": {"documents": "lognormal", "median": a.median}}
    if not a.quick:
        sources["corpus"] = {"path": make_corpus(tmp)}
    log(f"profiling micro-batches (one process) for {len(list(variants(sources)))} variants")
    fit = read_result(torchrun(1, [__file__, "--measure-worker", "--sources", json.dumps(sources),
                                   *[f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                                     if k in ("seq", "global_batch", "layers", "hidden", "seed",
                                              "measure_iters", "iters", "warmup")]]))
    kf = KnapFormerCost(k=fit["knapformer"]["k"], gamma=fit["knapformer"]["gamma"], hidden=a.hidden)
    stats = {v: plan_stats(a, sources[v[0]], v[1], v[2], kf) for v in variants(sources)}
    times: dict = {v: [] for v in stats}
    fits: list = []
    for r in range(a.rounds):
        for v in stats:
            log(f"round {r + 1}/{a.rounds}: {'/'.join(v)}")
            t, run_fit = run_once(a, sources[v[0]], v[1], v[2], tmp / "run")
            times[v].append(t)
            fits.append(run_fit)
    runs = [run_row(a, v, s, times, fit) for v, s in stats.items()]
    for r in runs:
        add_ratios(r, runs, times, a.warmup)
    result = {"runs": runs, "cost_fit": {k: fit[k] for k in ("knapformer", "adaptiveload",
                                                             "held_out_error", "samples")},
              "in_run_fits": in_run_fits(fits),
              "outlier_sweep": outlier_sweep(a, sources["lognormal"], kf),
              "settings": {k: v for k, v in vars(a).items() if k not in ("sources", "measure_worker")},
              "load_average": [load0, os.getloadavg()[0]]}
    for r in runs:
        del r["_tps"]
    if a.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def run_row(a, v, s: dict, times: dict, fit: dict) -> dict:
    tok = s["tokens"][a.warmup:]
    tps = [sum(tok) / sum(t[a.warmup:]) for t in times[v]]
    it_s = statistics.median(statistics.median(t[a.warmup:]) for t in times[v])
    return {"documents": v[0], "layout": v[1], "packer": v[2],
            "mb_cost_max_over_mean_predicted": round(s["predicted"], 3),
            "mb_cost_max_over_mean_lower_bound": round(s["lower_bound"], 3),
            "mb_cost_max_over_mean_measured": round(fit["measured"]["/".join(v)], 3),
            "tokens_per_s": round(statistics.median(tps), 1),
            "tokens_per_s_range": [round(min(tps), 1), round(max(tps), 1)],
            "iteration_s": round(it_s, 4), "packing_s": s["packing_s"],
            "packing_share": s["packing_s"] / it_s, "documents_complete": s["documents_complete"],
            "tokens_per_iteration": round(float(np.mean(tok)), 1), "_tps": tps}


def add_ratios(r: dict, runs: list, times: dict, warmup: int) -> None:
    """speedup: median over rounds of tokens/s over sequential packing's in the same round
    (runs interleaved, so a round's load hits both alike); its range over rounds."""
    base = next(x for x in runs if x["documents"] == r["documents"] and x["layout"] == r["layout"]
                and x["packer"] == "sequential")
    paired = [x / y for x, y in zip(r["_tps"], base["_tps"])]
    r["speedup"] = round(statistics.median(paired), 3)
    r["speedup_range"] = [round(min(paired), 3), round(max(paired), 3)]
    r["iteration_time_ratio"] = round(r["iteration_s"] / base["iteration_s"], 3)


def in_run_fits(fits: list) -> dict:
    """The runs' own fits (iterations 1-2, data_cost_fit events): median held-out error
    of each form over the runs, and how many runs fitted."""
    ok = [f for f in fits if f and f.get("held_out_error")]
    forms = ok[0]["held_out_error"] if ok else {}
    return {"runs": len(ok), "held_out_error_median": {
        k: statistics.median(f["held_out_error"][k] for f in ok) for k in forms}}


def outlier_sweep(a, source: dict, kf) -> list[dict]:
    """Planning only (lognormal, PP=2 shape, 40 iterations): predicted micro-batch
    max/mean and its lower bound for outlier levels and delays."""
    out = []
    for levels, delay in [("", 8), (f"{a.seq // 2}", 8), (f"{a.seq // 2},{3 * a.seq // 4}", 8),
                          (outlier_levels(a.seq), 4), (outlier_levels(a.seq), 8),
                          (outlier_levels(a.seq), 16)]:
        packer = "wlb+outlier" if levels else "wlb"
        st = plan_stats(a, source, "pp2", packer, kf, iters=40, levels=levels or None, delay=delay)
        out.append({"levels": levels or "none", "max_delay": delay,
                    "predicted": round(st["predicted"], 3), "lower_bound": round(st["lower_bound"], 3)})
    return out


def print_table(result: dict) -> None:
    print("| docs | layout | packer | mb max/mean predicted | lower bound | measured | tokens/s "
          "(range) | speedup (range) | iter time x | packing share | complete |")
    print("|---" * 11 + "|")
    for r in result["runs"]:
        lo, hi = r["tokens_per_s_range"]
        slo, shi = r["speedup_range"]
        print(f"| {r['documents']} | {r['layout']} | {r['packer']} | "
              f"{r['mb_cost_max_over_mean_predicted']:.3f} | "
              f"{r['mb_cost_max_over_mean_lower_bound']:.3f} | "
              f"{r['mb_cost_max_over_mean_measured']:.3f} | {r['tokens_per_s']:.0f} ({lo:.0f}-{hi:.0f}) | "
              f"{r['speedup']:.3f} ({slo:.2f}-{shi:.2f}) | {r['iteration_time_ratio']:.3f} | "
              f"{100 * r['packing_share']:.2f}% | {'yes' if r['documents_complete'] else 'NO'} |")
    f = result["cost_fit"]
    print(f"cost fit on {f['samples']} profiled (layer, micro-batch) samples: KnapFormer k="
          f"{f['knapformer']['k']:.3g} gamma={f['knapformer']['gamma']:.3f}; AdaptiveLoad p="
          f"{f['adaptiveload']['p']} R^2={f['adaptiveload']['r2']:.4f}; held-out mean |error|: "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in f["held_out_error"].items()))
    g = result["in_run_fits"]
    print(f"in-run fits ({g['runs']} runs, iterations 1-2): median held-out error "
          + ", ".join(f"{k} {100 * v:.1f}%" for k, v in g["held_out_error_median"].items()))
    print("outlier levels (planning only, lognormal, PP=2): "
          + "; ".join(f"{x['levels']} delay {x['max_delay']}: {x['predicted']:.3f} "
                      f"(bound {x['lower_bound']:.3f})" for x in result["outlier_sweep"]))
    print(f"load average: {result['load_average'][0]:.1f} at start, {result['load_average'][1]:.1f} at end")


if __name__ == "__main__":
    sys.exit(main())
