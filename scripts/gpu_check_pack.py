#!/usr/bin/env python
"""Pack every log, report and profile of a GPU check into ONE compressed archive.

    python scripts/gpu_check_pack.py ARCHIVE.tar.gz ROOT [ROOT ...] [--limit-mib 16]
                                     [--file-cap-mib 4] [--listing FILE]

Why: a lent GPU machine brings back at most 8 files of $OUT (16 MiB each, no more than two
folders down; /work/.library/device/README.md), and the first H200 run lost every
stderr.log, train.log and report.json that way (../shared/notes/h200-acceptance-1.md).
scripts/device_check.sh keeps its runs outside $OUT and calls this after each part.

What goes in: every file under each ROOT, named `<ROOT's name>/<path>`, except
checkpoints (a folder named `ckpt*`, `iter_<digits>` or `*checkpoint*`; a file ending in
.pt/.pth/.distcp/.safetensors/.bin/.ckpt over 1 MiB: the bit-exact rows' parameter dumps
of small models stay). A file over --file-cap-mib keeps its first and last halves of the
cap with a line saying how much was cut. If the compressed archive is still over
--limit-mib, the biggest files are dropped one by one until it fits. `MANIFEST.txt` in the
archive (and --listing, if given) lists every file: its bytes and "kept", "truncated",
"dropped: over the archive limit", "vanished while packing" or "excluded: checkpoint".
The archive is written under a hidden name beside ARCHIVE and renamed onto it. Exit 0; 2 on a usage error.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MIB = 1 << 20
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".distcp", ".safetensors", ".bin", ".ckpt")
CHECKPOINT_DIRS = re.compile(r"^(ckpt.*|iter_\d+|.*checkpoint.*)$")
SMALL_DUMP_BYTES = MIB  # a parameter dump of a test model below this is kept


@dataclass
class Entry:
    name: str           # inside the archive
    path: Path
    size: int
    status: str = "kept"

    def data(self, cap: int) -> bytes:
        raw = self.path.read_bytes()
        if len(raw) <= cap:
            return raw
        self.status = f"truncated to {cap} of {len(raw)} bytes"
        half = cap // 2
        note = f"\n[... gpu_check_pack.py cut {len(raw) - 2 * half} bytes here ...]\n".encode()
        return raw[:half] + note + raw[-half:]


def is_checkpoint(rel: Path, size: int) -> bool:
    if any(CHECKPOINT_DIRS.match(part) for part in rel.parts[:-1]):
        return True
    return rel.suffix in CHECKPOINT_SUFFIXES and size > SMALL_DUMP_BYTES


def _files(root: Path) -> list[Path]:
    """The plain files under `root`, sorted; os.walk skips a folder removed while it is
    listed (Path.rglob raises there)."""
    found = [Path(top, name) for top, _, names in os.walk(root) for name in names]
    return sorted(p for p in found if not p.is_symlink() and p.is_file())


def collect(roots: list[Path]) -> list[Entry]:
    """Every file under the roots, in name order, checkpoints marked excluded."""
    entries = []
    for root in roots:
        if not root.is_dir():
            continue
        for path in _files(root):
            rel = path.relative_to(root)
            try:
                size = path.stat().st_size
            except OSError:  # removed meanwhile (a run still writing: a save's temporary file)
                continue
            entry = Entry(f"{root.name}/{rel.as_posix()}", path, size)
            if is_checkpoint(rel, size):
                entry.status = "excluded: checkpoint"
            entries.append(entry)
    return entries


def manifest(entries: list[Entry]) -> str:
    lines = [f"{e.size:>12}  {e.name}  {e.status}" for e in entries]
    kept = sum(e.status == "kept" or e.status.startswith("truncated") for e in entries)
    return "\n".join([f"{kept} of {len(entries)} files packed (bytes before packing)", *lines]) + "\n"


def _write(archive: Path, entries: list[Entry], cap: int) -> int:
    with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
        for e in entries:
            if e.status != "kept" and not e.status.startswith("truncated"):
                continue
            try:
                data, mtime = e.data(cap), int(e.path.stat().st_mtime)
            except OSError as err:  # removed or unreadable since it was listed
                e.status = f"vanished while packing: {type(err).__name__}"
                continue
            info = tarfile.TarInfo(e.name)
            info.size, info.mtime = len(data), mtime
            tar.addfile(info, io.BytesIO(data))
        text = manifest(entries).encode()
        info = tarfile.TarInfo("MANIFEST.txt")
        info.size = len(text)
        tar.addfile(info, io.BytesIO(text))
    return archive.stat().st_size


def pack(archive: Path, roots: list[Path], limit: int = 16 * MIB, cap: int = 4 * MIB,
         listing: Optional[Path] = None) -> list[Entry]:
    """Write the archive (at most `limit` bytes); returns every entry with its status.
    Written beside `archive` and renamed onto it: a kill while packing (device_check.sh
    packs after each part) leaves the previous archive whole, never a cut one."""
    entries = collect(roots)
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.partial")
    try:
        while _write(partial, entries, cap) > limit:
            packed = [e for e in entries if e.status == "kept" or e.status.startswith("truncated")]
            if not packed:
                break
            max(packed, key=lambda e: e.size).status = "dropped: over the archive limit"
        partial.replace(archive)
    finally:
        partial.unlink(missing_ok=True)  # a failed write's: never a file beside the archive
    if listing is not None:
        listing.write_text(manifest(entries))
    return entries


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", type=Path)
    parser.add_argument("roots", type=Path, nargs="+")
    parser.add_argument("--limit-mib", type=float, default=16.0)
    parser.add_argument("--file-cap-mib", type=float, default=4.0)
    parser.add_argument("--listing", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.limit_mib <= 0 or args.file_cap_mib <= 0:
        parser.error("--limit-mib and --file-cap-mib must be > 0")
    entries = pack(args.archive, args.roots, int(args.limit_mib * MIB), int(args.file_cap_mib * MIB),
                   args.listing)
    packed = sum(e.status == "kept" or e.status.startswith("truncated") for e in entries)
    left = [e for e in entries if e.status.startswith(("dropped", "truncated"))]
    print(f"{args.archive.name}: {packed} of {len(entries)} files, {args.archive.stat().st_size} bytes"
          + (f"; {len(left)} truncated or dropped (MANIFEST.txt)" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
