"""Fuzz `dynmo-train`'s flags and YAML through the validation path (no training).

Hypothesis sets one or two settings to arbitrary values (wrong types, NaN/inf, negative,
huge, strings, lists, nested mappings), through the YAML file or the flag, or writes a
malformed YAML file (duplicate keys, tabs, bad bytes, dotted names). It then runs what
`dynmo-train` runs before any process group exists (`dynmo_plugin.train.validate`), in
process. Every outcome must be one of:

* a validated RunConfig;
* a UserError whose message is one line naming a setting: the one set, in dotted form
  (`model.num_layers`, `rebalance.interval`), whenever the problem is that value's type
  or range ("expected ..."); for a cross-field problem, some setting by dotted key or flag;
* argparse's own exit 2 for a flag value of the wrong type (`--num-layers four`).
"""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.config import DynmoConfig, ModelArgs, flag_of as _flag, leaf_fields as _leaf_fields
from dynmo_plugin.config.checks import PLUGIN_SECTIONS
from dynmo_plugin.errors import UserError
from dynmo_plugin.train import build_parser, validate

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FIELDS = {f"model.{k}": f for k, f, _ in _leaf_fields(ModelArgs)}
FIELDS.update({k: f for k, f, _ in _leaf_fields(DynmoConfig)})
# reading real files is out of scope here: tests/config/test_config_input.py covers these paths
SKIP = {"model.data.path", "model.load", "model.save", "model.output"}
KEYS = sorted(k for k in FIELDS if k not in SKIP)
NAMES = ({k.rsplit(".", i)[0] for k in FIELDS for i in range(k.count(".") + 1)}
         | {_flag(f) for f in FIELDS.values()})  # dotted keys, their sections, flags
WHOLE_FILE = ("YAML", "UTF-8", "mapping of sections", "given twice", "unknown key", "holds no settings")

values = st.one_of(
    st.integers(-3, 40), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.sampled_from(["", "four", "exact", "Ett|ttL", "1,1,0,0", "none",
                                                "gloo", "cosine", "5:Ett|ttL", "1e9", "-1"]),
    st.text(max_size=6), st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.sampled_from(["a", "2", "interval"]), st.integers(0, 3), max_size=2))


def _nest(key: str, value) -> dict:
    head, _, rest = key.partition(".")
    return {head: _nest(rest, value) if rest else value}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _run(argv: list[str], cfg_out: list | None = None) -> tuple[str, str]:
    """('ok' | 'user' | 'argparse', message) of validate() on `argv`; the validated
    config is appended to `cfg_out` when given."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 2, argv
            return "argparse", err.getvalue()
    try:
        cfg = validate(args, world_size=2)
    except UserError as e:
        return "user", str(e)
    if cfg_out is not None:
        cfg_out.append(cfg)
    return "ok", ""


def _check(outcome: str, message: str, keys: list[str]) -> None:
    if outcome == "argparse":  # one line, as Megatron-LM users expect (not the 103-line usage)
        lines = message.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dynmo-train: error: argument"), message
        return
    if outcome == "ok":
        return
    assert message and "\n" not in message, message
    assert "Traceback" not in message
    if keys and re.search(r": expected (?!a section)", message):  # a value's type or range
        assert any(f": {k}: expected" in message or f"{k}." in message for k in keys), (keys, message)
    else:
        assert any(n in message for n in NAMES) or any(w in message for w in WHOLE_FILE), message


@FUZZ
@given(pairs=st.lists(st.tuples(st.sampled_from(KEYS), values), min_size=1, max_size=2),
       via_flag=st.booleans())
def test_settings_validate_or_fail_in_one_line(tmp_path_factory, pairs, via_flag):
    tmp = tmp_path_factory.mktemp("fuzz")
    argv: list[str] = []
    doc: dict = {}
    for key, value in pairs:
        f = FIELDS[key]
        scalar = not isinstance(value, (list, dict)) and value is not None
        if via_flag and scalar and "bool" not in str(f.type):
            argv.append(f"{_flag(f)}={value}")
        elif via_flag and value is True and "bool" in str(f.type):
            argv.append(_flag(f))
        else:
            doc = _merge(doc, _nest(key, value))
    if doc:
        path = tmp / "c.yaml"
        path.write_text(yaml.safe_dump(doc))
        argv = ["--dynmo-config", str(path), *argv]
    cfgs: list = []
    outcome, message = _run(argv, cfgs)
    _check(outcome, message, [k for k, _ in pairs])
    # the oracle of issue 36 item 1: a plugin flag never validates while DynMo is off
    plugin_flags = [a for a in argv if a.split("=")[0] in PLUGIN_FLAGS]
    if outcome == "ok" and plugin_flags:
        assert cfgs[0].dynmo.enabled, (argv, "a plugin flag validated with DynMo off")


PLUGIN_FLAGS = {_flag(f) for k, f in FIELDS.items() if k.split(".")[0] in PLUGIN_SECTIONS}

# ---- paths the run writes (issue 36 item 2): which outcome is right, not just one line ------
PATH_KINDS = ("new", "nested new", "existing dir", "under a file", "the file itself", "empty",
              "blank", "report.json a directory")


def _make_path(tmp: Path, kind: str) -> str:
    blocker = tmp / "a_file"
    blocker.write_text("x")
    if kind == "report.json a directory":
        (tmp / "out" / "report.json").mkdir(parents=True)
        return str(tmp / "out")
    return {"new": str(tmp / "new"), "nested new": str(tmp / "a" / "b" / "c"),
            "existing dir": str(tmp), "under a file": str(blocker / "sub" / "dir"),
            "the file itself": str(blocker), "empty": "", "blank": "  "}[kind]


@FUZZ
@given(kind=st.sampled_from(PATH_KINDS), flag=st.sampled_from(["--output", "--save"]),
       dynmo=st.booleans())
def test_paths_are_checked_before_anything_is_made(tmp_path_factory, kind, flag, dynmo):
    """Refused exactly when the run could not write there (an empty or blank path, a
    file on the way, report.json a directory under --output), in one line naming the
    flag; nothing is created either way."""
    tmp = tmp_path_factory.mktemp("paths")
    path = _make_path(tmp, kind)
    argv = [flag, path] + (["--output", str(tmp / "o")] if flag == "--save" else [])
    before = sorted(p for p in tmp.rglob("*"))
    outcome, message = _run(argv + (["--dynmo"] if dynmo else []))
    bad = kind in ("under a file", "the file itself", "empty", "blank") or (
        kind == "report.json a directory" and flag == "--output")
    assert outcome == ("user" if bad else "ok"), (kind, flag, message)
    if bad:
        assert message.startswith(f"flag {flag}: model.{flag[2:]}: ") and "\n" not in message, message
    assert sorted(p for p in tmp.rglob("*")) == before  # validation creates nothing


yaml_texts = st.one_of(
    st.binary(max_size=40).map(lambda b: b), st.sampled_from([b"", b"\n\n", b"# only a comment\n"]),
    st.sampled_from([b"model:\n  num_layers: 4\nmodel:\n  hidden_size: 8\n",
                     b"rebalance:\n\tinterval: 2\n", b"rebalance: [\n", b"rebalance: 5\n",
                     b"model.num_layers: 4\n", b"\xff\xfemodel: {}\n", b"- 1\n- 2\n",
                     b"profiling: {window: 2, window: 3}\n", b"repack:\n  enabled: yes\n  mode: checkpoint\n",
                     b"model: {num_layers: 4, pipeline_model_parallel_size: 2, "
                     b"pipeline_model_parallel_layout: 'Et|tttL'}\n", b"dynamism:\n  kind: moe\n  pruning: {start: 2}\n",
                     b"model: {lr: .inf}\n", b"model: {lr: .nan}\n", b"{a: 1\n", b"? [1, 2]\n: 3\n"]))


# The fuzzer's fixed texts, each with the outcome its rule gives and a word of the reason:
# the fuzzer checks the form of any outcome; this says which one is right.
YAML_WANT = {
    b"model:\n  num_layers: 4\nmodel:\n  hidden_size: 8\n": ("user", "key 'model' given twice"),
    b"rebalance:\n\tinterval: 2\n": ("user", "not valid YAML"),       # a tab cannot indent
    b"rebalance: [\n": ("user", "not valid YAML"),
    b"rebalance: 5\n": ("user", "rebalance: expected a section"),
    b"model.num_layers: 4\n": ("user", "dotted key names are not read"),
    b"\xff\xfemodel: {}\n": ("user", "not UTF-8"),
    b"- 1\n- 2\n": ("user", "expected a mapping of sections at the top level"),
    b"profiling: {window: 2, window: 3}\n": ("user", "key 'window' given twice"),
    b"repack:\n  enabled: yes\n  mode: checkpoint\n": ("user", "give --save"),
    b"model: {num_layers: 4, pipeline_model_parallel_size: 2, "
    b"pipeline_model_parallel_layout: 'Et|tttL'}\n": ("ok", ""),      # 4 layers over 2 stages
    b"dynamism:\n  kind: moe\n  pruning: {start: 2}\n": ("user", "dynamism.pruning.start: set, but"),
    b"model: {lr: .inf}\n": ("user", "model.lr: expected a finite number"),
    b"model: {lr: .nan}\n": ("user", "model.lr: expected a finite number"),
    b"{a: 1\n": ("user", "not valid YAML"),
    b"? [1, 2]\n: 3\n": ("user", "not valid YAML"),                  # a list as a key
    b"": ("user", "holds no settings"), b"\n\n": ("user", "holds no settings"),
    b"# only a comment\n": ("user", "holds no settings"),
}


@pytest.mark.parametrize("text", list(YAML_WANT), ids=range(len(YAML_WANT)))
def test_each_fixed_yaml_text_gets_the_outcome_its_rule_gives(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_bytes(text)
    outcome, message = _run(["--dynmo-config", str(path)])
    want, reason = YAML_WANT[text]
    assert outcome == want and reason in message, (text, outcome, message)


@FUZZ
@given(text=yaml_texts)
def test_yaml_files_validate_or_fail_in_one_line(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_bytes(text)
    outcome, message = _run(["--dynmo-config", str(path)])
    assert outcome in ("ok", "user"), message
    _check(outcome, message, [])
    if outcome == "user":
        assert message.startswith(str(path)), message
    if not text.strip():  # an empty file is the wrong file, not an empty configuration
        assert outcome == "user" and "holds no settings" in message, message


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused_everywhere(value):
    """argparse's float() reads these spellings, so validation must refuse them."""
    for key, f in FIELDS.items():
        if "float" in str(f.type):
            outcome, message = _run([f"{_flag(f)}={value}"])
            assert outcome == "user" and f": {key}: expected" in message, (key, message)


# ---- a checkpoint of another model (issue 36 item 8): refused exactly when a shape differs ----
_SHAPE_FLAGS = {"num_layers": ("--num-layers", st.integers(1, 12)),
                "hidden_size": ("--hidden-size", st.sampled_from([16, 32, 64])),
                "num_attention_heads": ("--num-attention-heads", st.sampled_from([1, 2, 4])),
                "vocab_size": ("--vocab-size", st.sampled_from([128, 256, 512]))}


@FUZZ
@given(saved=st.fixed_dictionaries({k: s for k, (_, s) in _SHAPE_FLAGS.items()}),
       here=st.fixed_dictionaries({k: s for k, (_, s) in _SHAPE_FLAGS.items()}))
def test_a_checkpoint_of_another_model_names_the_first_setting_that_differs(tmp_path_factory, saved, here):
    from dynmo_plugin.megatron.checkpoint.directory import MODEL_KEYS, model_record
    from dynmo_plugin.config import ModelArgs
    ck = tmp_path_factory.mktemp("ck")
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    (ck / "iter_0000003").mkdir()
    record = model_record(ModelArgs(**saved))
    (ck / "iter_0000003" / "meta.json").write_text(json.dumps(
        {"format": "dynmo-dist-ckpt/1", "iteration": 3, "model": record}))
    argv = [a for k, v in here.items() for a in (_SHAPE_FLAGS[k][0], str(v))]
    outcome, message = _run([*argv, "--load", str(ck), "--output", str(ck / "out")])
    now = model_record(ModelArgs(**here))
    differs = [k for k in MODEL_KEYS if record[k] != now[k]]
    assert outcome == "user" and "\n" not in message, message
    if differs:  # the first one, checkpoint vs command line, and the flag
        k = differs[0]
        assert (f"the checkpoint is of another model: {k} {record[k]} in the checkpoint" in message
                and f"{now[k]} here (--{k.replace('_', '-')})" in message), (differs, message)
    else:  # the same model: what is wrong is the (incomplete) checkpoint itself
        assert "another model" not in message and "incomplete" in message, message
