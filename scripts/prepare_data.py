#!/usr/bin/env python
"""Turn text files into Megatron's indexed dataset (.bin/.idx) with a byte-level tokenizer.

Like Megatron-LM's tools/preprocess_data.py, offline: every document's UTF-8 bytes as
tokens 0-255 plus an end-of-document token (256); the tokenizer is saved beside the
data as PREFIX.tokenizer.json, and `dynmo-train --data-path PREFIX` reads both.

    python scripts/prepare_data.py --input FILES... --output-prefix P [--split blank-lines]

A document is a whole file (`--split file`, the default), or a block of a file
between runs of two or more blank lines (`--split blank-lines`: the top-level
definitions of Python source; one blank line does not split, so prose whose paragraphs
are one blank line apart stays one document). `.jsonl` inputs hold one document per line in
the field given by `--json-key` (Megatron-LM's input format). Prints one summary line
(or one JSON document with --json) on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Iterator

import numpy as np

from dynmo_plugin.megatron.data.indexed import write_indexed
from dynmo_plugin.data.tokenizer import ByteTokenizer

_BLANKS = re.compile(r"\n[ \t]*\n([ \t]*\n)+")


def texts(path: str, split: str, json_key: str) -> Iterator[str]:
    """The documents of one input file."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        if path.endswith(".jsonl"):
            for number, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[json_key]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise SystemExit(f"prepare_data: error: {path}:{number}: expected a JSON "
                                         f"object with a {json_key!r} string ({e!r})") from e
            return
        text = fh.read()
    yield from (_BLANKS.split(text)[::2] if split == "blank-lines" else [text])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text or .jsonl files")
    p.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin, P.idx, P.tokenizer.json")
    p.add_argument("--split", choices=("file", "blank-lines"), default="file",
                   help="what one document is: a whole file (the default), or with blank-lines a "
                        "block between runs of two or more blank lines (one blank line does not split)")
    p.add_argument("--json-key", default="text", help="field of a .jsonl line holding the text")
    p.add_argument("--min-chars", type=int, default=1, help="skip documents shorter than this")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    args = p.parse_args(argv)
    missing = [f for f in args.input if not os.path.isfile(f)]
    if missing:
        print(f"prepare_data: error: input not found: {', '.join(missing[:5])}", file=sys.stderr)
        return 2
    tok = ByteTokenizer()
    lengths: list[int] = []

    def documents() -> Iterator[np.ndarray]:
        for path in args.input:
            for text in texts(path, args.split, args.json_key):
                if len(text.strip()) >= args.min_chars:
                    ids = np.append(tok.tokenize(text), tok.eod)
                    lengths.append(len(ids))
                    yield ids

    count = write_indexed(args.output_prefix, documents(), tok)
    if count == 0:
        print("prepare_data: error: no documents in the input (all shorter than --min-chars?)",
              file=sys.stderr)
        return 2
    summary = {"prefix": args.output_prefix, "documents": count, "tokens": int(sum(lengths)),
               "median_tokens": int(np.median(lengths)), "max_tokens": int(max(lengths)),
               "vocab_size": tok.vocab_size, "tokenizer": "byte"}
    print(json.dumps(summary) if args.json else
          " ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
