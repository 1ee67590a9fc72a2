"""Real and synthetic documents: the indexed dataset round-trips, the stream, the config.

In-process except the two torchrun runs at the end (PP=2 lognormal documents, and
PP=1 x DP=2 on a corpus prepared from the Python standard library's sources in
adaptive batches).
"""
import argparse
import json
import math
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from launch import losses, train

from dynmo_plugin.config import ConfigError, add_dynmo_args, add_model_args
from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.data import SyntheticTokens
from dynmo_plugin.data.documents import DocumentStream, LognormalDocuments
from dynmo_plugin.megatron.data.indexed import IndexedDocuments
from dynmo_plugin.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
STDLIB_JSON = sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))


def _run_prepare(tmp_path: Path, files, *extra) -> tuple[str, dict]:
    import subprocess
    import sys
    prefix = str(tmp_path / "corpus")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/prepare_data.py"), "--input",
                          *map(str, files), "--output-prefix", prefix, "--json", *extra],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return prefix, json.loads(out)


def test_prepare_then_read_gives_the_same_tokens(tmp_path):
    prefix, summary = _run_prepare(tmp_path, STDLIB_JSON)
    tok = ByteTokenizer()
    docs = IndexedDocuments(prefix)
    assert summary["documents"] == len(docs) == len(STDLIB_JSON)
    for i, path in enumerate(STDLIB_JSON):
        text = path.read_text(encoding="utf-8")
        assert tok.detokenize(docs.document(i)) == text
        assert docs.document(i)[-1] == tok.eod
        assert docs.lengths()[i] == len(text.encode()) + 1 - 1  # bytes + EOD, minus one
    assert docs.vocab_size == 384  # 257 padded to a multiple of 128
    piece = docs.tokens(0, 5, 10)
    assert list(piece) == list(docs.document(0)[5:16])


def test_prepare_splits_on_blank_lines_and_rejects_bad_input(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one\n\n\ntwo two\n\n\n\nthree\n")
    prefix, summary = _run_prepare(tmp_path, [f], "--split", "blank-lines")
    assert summary["documents"] == 3
    docs = IndexedDocuments(prefix)
    assert [ByteTokenizer().detokenize(docs.document(i)) for i in range(3)] == ["one", "two two", "three\n"]
    import subprocess
    import sys
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/prepare_data.py"), "--input",
                          str(tmp_path / "nope.txt"), "--output-prefix", prefix],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "input not found" in bad.stderr


def test_synthetic_token_stream_is_unchanged():
    """The default stream, bit for bit as before the data package (other tests' exact
    loss comparisons depend on it)."""
    data = SyntheticTokens(seed=1234, vocab_size=256, seq_length=32, global_batch_size=16,
                           micro_batch_size=2)
    assert data.sample(3, 5)[:8].tolist() == [79, 80, 81, 82, 47, 84, 85, 86]
    mb = next(data.micro_batches(2, 1, 2))
    assert mb["tokens"].shape == (2, 32) and int(mb["tokens"].sum()) == 11474


def test_lognormal_lengths_and_stream_pieces():
    src = LognormalDocuments(seed=3, vocab_size=256, median=200, sigma=1.0, max_length=1500)
    lengths = src.lengths()
    assert 180 < np.median(lengths) < 220 and lengths.max() <= 1500 and lengths.min() >= 8
    assert np.array_equal(lengths, LognormalDocuments(seed=3, vocab_size=256, median=200,
                                                      sigma=1.0, max_length=1500).lengths())
    stream = DocumentStream(src, seed=3, max_length=512)
    per_doc: dict[int, int] = {}
    i = 0
    while len(per_doc) < len(src) or i < stream._per_epoch:
        p = stream.piece(i)
        assert 1 <= p.length <= 512 and p.start % 512 == 0
        per_doc[p.doc] = per_doc.get(p.doc, 0) + p.length
        i += 1
    assert all(per_doc[d] == lengths[d] for d in per_doc)  # an epoch covers every position once
    t = stream.tokens(stream.piece(0))
    assert len(t) == stream.piece(0).length + 1 and t.max() < 256


def _cfg(*flags, world_size=2):
    p = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    return load_run_config(p.parse_args(list(flags)), world_size=world_size)


def test_config_checks(tmp_path):
    prefix, _ = _run_prepare(tmp_path, STDLIB_JSON[:1])
    cfg = _cfg("--data-path", prefix, "--micro-batch-size", "1", "--global-batch-size", "4")
    assert cfg.model.vocab_size == 384 and cfg.model.data.packed
    assert not _cfg().model.data.packed
    with pytest.raises(ConfigError, match="--micro-batch-size 1"):
        _cfg("--data-documents", "lognormal")
    with pytest.raises(ConfigError, match="not found"):
        _cfg("--data-path", str(tmp_path / "missing"), "--micro-batch-size", "1")
    _check_broken_dataset_files(tmp_path, prefix)
    with pytest.raises(ConfigError, match="exceed --seq-length"):
        _cfg("--data-documents", "lognormal", "--micro-batch-size", "1",
             "--data-outlier-thresholds", "16,64")
    with pytest.raises(ConfigError, match="ascending"):
        _cfg("--data-documents", "lognormal", "--micro-batch-size", "1",
             "--data-outlier-thresholds", "16,8")
    packed = ("--data-documents", "lognormal", "--micro-batch-size", "1")
    with pytest.raises(ConfigError, match="does not pack documents; --data-packer wlb"):
        _cfg(*packed, "--data-batching", "adaptive", "--data-packer", "wlb")
    with pytest.raises(ConfigError, match="give --data-path or --data-documents"):
        _cfg("--data-batching", "adaptive")
    with pytest.raises(ConfigError, match="must hold one row"):
        _cfg(*packed, "--data-batching", "adaptive", "--data-mem-tokens", "16")
    for kind in ("gradual_pruning", "layer_freezing"):  # their layers pass packed params on
        assert _cfg(*packed, "--dynmo-dynamism", kind).dynmo.dynamism.kind == kind
    for kind in ("early_exit", "mixture_of_depths", "sparse_attention", "moe"):
        with pytest.raises(ConfigError, match=f"cannot train with dynamism '{kind}': .*synthetic"):
            _cfg(*packed, "--dynmo-dynamism", kind)


def _check_broken_dataset_files(tmp_path: Path, prefix: str) -> None:
    """Each worker's Megatron IndexedDataset asserted on a broken index (a traceback per
    rank), and a tokenizer file not in UTF-8 raised UnicodeDecodeError: each is one line
    before any worker starts."""
    import shutil
    idx, tokenizer = Path(prefix + ".idx"), Path(prefix + ".tokenizer.json")
    flags = ("--data-path", str(tmp_path / "broken"), "--micro-batch-size", "1")
    cases = [("garbage", b"not an index at all, longer than the header", tokenizer.read_bytes(),
              "broken.idx: not a Megatron dataset index (bad header)"),
             ("truncated", idx.read_bytes()[:-8], tokenizer.read_bytes(), "broken.idx: truncated"),
             ("version", idx.read_bytes()[:9] + (2).to_bytes(8, "little") + idx.read_bytes()[17:],
              tokenizer.read_bytes(), "index version 2, expected 1"),
             ("tokenizer", idx.read_bytes(), b"\xff\xfe{}", "cannot read the tokenizer")]
    for _, index, tok, needle in cases:
        shutil.copy(prefix + ".bin", tmp_path / "broken.bin")
        (tmp_path / "broken.idx").write_bytes(index)
        (tmp_path / "broken.tokenizer.json").write_bytes(tok)
        with pytest.raises(ConfigError, match=re.escape(needle)) as err:
            _cfg(*flags)
        assert "\n" not in str(err.value)


# ---- real runs ---------------------------------------------------------------------------------
_SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "256", "--micro-batch-size", "1", "--train-iters", "6", "--lr", "3e-3"]


def test_lognormal_documents_train_on_two_stages_with_wlb_and_outliers(tmp_path):
    """PP=2, WLB + outlier queues balanced by a KnapFormer model fitted from the profiler
    at iterations 1-2, under layer freezing; the rebalance at iteration 4 decides from a
    profile re-costed to the run's length mix by the per-layer models; the checkpoint's
    meta carries the data state (position, queues, fitted models) and a resumed run
    continues from it without refitting."""
    flags = [*_SMALL, "--global-batch-size", "4", "--pipeline-model-parallel-size", "2",
             "--data-documents", "lognormal", "--data-lognormal-median", "48",
             "--data-packer", "wlb", "--data-outlier-thresholds", "128",
             "--data-outlier-max-delay", "2", "--data-cost-model", "knapformer",
             "--dynmo-dynamism", "layer_freezing", "--dynmo", "--dynmo-rebalance-interval", "4",
             "--save", str(tmp_path / "ckpt")]
    rep = train(2, [*flags, "--save-interval", "6"], tmp_path / "a")
    ls = losses(rep)
    assert all(math.isfinite(x) for x in ls) and ls[-1] < ls[0]
    fit = [e for e in rep["events"] if e.get("kind") == "data_cost_fit"]
    assert [e["iteration"] for e in fit] == [2] and fit[0]["model"]["form"] == "knapformer"
    assert set(fit[0]["held_out_error"]) == {"knapformer", "adaptiveload", "tokens"}
    data = json.loads((tmp_path / "ckpt/iter_0000006/meta.json").read_text())["data"]
    assert data["kind"] == "packed" and data["planned"] == 6
    assert data["cost_model"] == fit[0]["model"] and data["outliers"]["thresholds"] == [128]
    assert set(data["layer_models"]) == {"1", "2"}  # per layer, both stages': the balancer's
    assert [e["iteration"] for e in rep["events"] if e.get("kind") == "rebalance"] == [4]
    flags[flags.index("--train-iters") + 1] = "8"
    resumed = train(2, [*flags, "--load", str(tmp_path / "ckpt")], tmp_path / "b")
    assert [it["iteration"] for it in resumed["iterations"]] == [7, 8]
    assert not [e for e in resumed["events"] if e.get("kind") == "data_cost_fit"]


def test_indexed_corpus_trains_data_parallel_with_adaptive_batches(tmp_path):
    """DP=2 on the stdlib corpus, unpacked: AdaptiveLoad batches (B(S) rows of bucket S,
    from a model fitted at iterations 1-2), under gradual pruning (a round at iteration 4)."""
    prefix, _ = _run_prepare(tmp_path, STDLIB_JSON, "--split", "blank-lines")
    rep = train(2, [*_SMALL, "--global-batch-size", "4", "--data-path", prefix,
                    "--data-batching", "adaptive", "--data-cost-model", "adaptiveload",
                    "--dynmo-dynamism", "gradual_pruning", "--dynmo-pruning-start", "2",
                    "--dynmo-pruning-interval", "2", "--dynmo-pruning-rounds", "2"],
                tmp_path / "run")
    ls = losses(rep)
    assert rep["config"]["model"]["vocab_size"] == 384
    assert all(math.isfinite(x) for x in ls) and ls[-1] < ls[0]
    kinds = [(e.get("kind"), e.get("iteration")) for e in rep["events"]]
    assert ("data_cost_fit", 2) in kinds and ("dynamism", 4) in kinds
