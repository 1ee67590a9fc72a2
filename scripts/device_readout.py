#!/usr/bin/env python
"""What one device call brought back, read in one place.

    python scripts/device_readout.py OUT_DIR [--json]

OUT_DIR: scripts/device_check.sh's $OUT as the device tool returns it (device_check.txt,
gpu_check.json, megatron_lm.txt, logs.tar.gz; any may be missing: a call the limit cut).
A lent GPU gives one call per session, and the session that gets it has little time left
to read: this prints each part's exit and seconds, every row's verdict and detail (the
failed first), megatron_lm_gpu_check.sh's PASS/FAIL lines, the archive's manifest counts,
and the lines of every packed log that docs/gpu.md ("The next device call") says to read
first: kernels attributed to forward spans only, TEARDOWN_CUPTI, kernel records CUPTI
dropped (kernels.kernel_coverage), and the error line
that ends each traceback. --json: the same as one JSON document on stdout. Exit 0; 2 when
OUT_DIR holds none of the call's files.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Optional

# log lines worth a look before any row's detail (each with the file it came from)
SIGNALS = {
    "forward_only": re.compile(r"GPU kernels were attributed to forward spans only"),
    "teardown_cupti": re.compile(r"TEARDOWN_CUPTI"),
    "kernel_records_lost": re.compile(r"kernel records for [0-9.]+% of the window's kernel launches"),
}
ORDER = {"FAIL": 0, "pass": 2}  # failed rows first, then skipped, then passed (gpu_checks.common.Row)
# megatron_lm_gpu_check.sh's verdict lines and why a run ended
MLM_LINES = re.compile(r"PASS|FAIL|not run|skipped|error:|failed \(exit|deadline|no time left|no checkpoint|"
                       r"\b[123]/3 ")
DETAIL_CHARS = 600


def _error_lines(name: str, lines: list[str]) -> list[dict]:
    """The line that ends each traceback (the exception and its message)."""
    found, inside = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("Traceback (most recent call last)"):
            inside = True
        elif inside and line and not line[0].isspace():
            found.append({"file": name, "line": number, "text": line.strip()[:300]})
            inside = False
    return found


def read_archive(path: Path) -> dict:
    """The manifest's counts by status and the signal lines of every packed text file."""
    signals: dict[str, list[dict]] = {key: [] for key in (*SIGNALS, "errors")}
    counts: dict[str, int] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            handle = tar.extractfile(member) if member.isfile() else None
            if handle is None:
                continue
            lines = handle.read().decode("utf-8", "replace").splitlines()
            if member.name == "MANIFEST.txt":
                for line in lines[1:]:  # "<bytes>  <name>  <status>" (gpu_check_pack.manifest)
                    kind = line.strip().split("  ", 2)[-1].split()[0].rstrip(":")  # kept, truncated, ...
                    counts[kind] = counts.get(kind, 0) + 1
                continue
            for key, pattern in SIGNALS.items():
                signals[key] += [{"file": member.name, "line": n, "text": x.strip()[:300]}
                                 for n, x in enumerate(lines, 1) if pattern.search(x)]
            signals["errors"] += _error_lines(member.name, lines)
    return {"manifest": counts, "signals": signals}


def readout(out: Path) -> Optional[dict]:
    """Everything the call returned, as data; None when none of its files is there."""
    text = lambda name: (out / name).read_text() if (out / name).is_file() else None  # noqa: E731
    parts, mlm, table = text("device_check.txt"), text("megatron_lm.txt"), text("gpu_check.json")
    archive = out / "logs.tar.gz"
    if parts is None and mlm is None and table is None and not archive.is_file():
        return None
    rows = json.loads(table)["rows"] if table else []
    rows = sorted(rows, key=lambda r: ORDER.get(r["result"], 1))
    return {
        "parts": parts.splitlines() if parts else ["device_check.txt: missing (the call was cut before it)"],
        "rows": [{k: r.get(k) for k in ("check", "result", "detail", "seconds")} for r in rows],
        "megatron_lm": [x for x in (mlm or "").splitlines() if MLM_LINES.search(x)],
        "archive": read_archive(archive) if archive.is_file() else None,
    }


def render(data: dict) -> str:
    lines = ["== parts (device_check.txt)", *data["parts"]]
    rows = data["rows"]
    tally = {k: sum(r["result"].startswith(k) for r in rows) for k in ("pass", "FAIL", "skipped")}
    lines.append(f"== rows (gpu_check.json): {tally['pass']} pass, {tally['FAIL']} FAIL, {tally['skipped']} skipped")
    for r in rows:
        detail = (r["detail"] or "")[:DETAIL_CHARS]
        lines.append(f"{r['result'][:24]:<24} {r['check']:<28} {detail}")
    lines += ["== megatron_lm.txt", *(data["megatron_lm"] or ["(no PASS/FAIL line)"])]
    archive = data["archive"]
    if archive is None:
        return "\n".join([*lines, "== logs.tar.gz: missing"])
    lines.append("== logs.tar.gz: " + ", ".join(f"{n} {k}" for k, n in sorted(archive["manifest"].items())))
    for key, found in archive["signals"].items():
        lines.append(f"-- {key}: {len(found)}")
        lines += [f"   {s['file']}:{s['line']}  {s['text']}" for s in found[:20]]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the device call's $OUT as it came back")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    data = readout(args.out)
    if data is None:
        print(f"device_readout.py: error: {args.out} holds none of device_check.sh's files "
              "(device_check.txt, gpu_check.json, megatron_lm.txt, logs.tar.gz): give the call's $OUT",
              file=sys.stderr)
        return 2
    print(json.dumps(data, indent=1) if args.json else render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
