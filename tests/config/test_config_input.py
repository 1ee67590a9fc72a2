"""Bad input found before any process group exists, each as one line naming the key
in dotted form and the fix (issue 28: each of these traced back or was accepted)."""
from __future__ import annotations

import pytest

from dynmo_plugin.config import ConfigError
from dynmo_plugin.train import build_parser, main, validate


def _validate(argv, world_size=2):
    return validate(build_parser().parse_args(argv), world_size)


def _yaml(tmp_path, text: str | bytes):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize("text,needle", [
    ("model:\n  num_layers: 4\nmodel:\n  hidden_size: 32\n", "c.yaml:3:1: key 'model' given twice (first on line 1)"),
    ("rebalance:\n  interval: 2\n  interval: 3\n", "c.yaml:3:3: key 'interval' given twice"),
    ("rebalance:\n  interval: [3\n", "c.yaml:3:1: not valid YAML"),
    ("rebalance:\n\tinterval: 3\n", "c.yaml:2:1: not valid YAML"),
    (b"rebalance:\n  interval: 3 # \xff\xfe\n", "not UTF-8 text"),
    ("model:\n  num_layers: \"four\"\n", "c.yaml: model.num_layers: expected an integer, got 'four'"),
    ("model:\n  lr: .inf\n", "c.yaml: model.lr: expected a finite number, got inf"),
    ("rebalance: 5\n", "c.yaml: rebalance: expected a section (a mapping of allow_empty_stages"),
    ("model.num_layers: 4\n", "c.yaml: model.num_layers: dotted key names are not read; nest the key instead: model: {num_layers: ...}"),
])
def test_yaml_problems_name_the_place(tmp_path, text, needle):
    with pytest.raises(ConfigError) as err:
        _validate(["--dynmo-config", _yaml(tmp_path, text)])
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_a_directory_as_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="it is a directory; give the YAML file"):
        _validate(["--dynmo-config", str(tmp_path)])


@pytest.mark.parametrize("argv,needle", [
    (["--seq-length", "32", "--max-position-embeddings", "8"],
     "model.seq_length (32) exceeds model.max_position_embeddings (8)"),
    (["--lr", "inf"], "flag --lr: model.lr: expected a finite number, got inf"),
    (["--dynmo-gate-margin", "inf"], "rebalance.margin: expected a finite number"),
])
def test_sizes_and_values(argv, needle):
    with pytest.raises(ConfigError) as err:
        _validate(argv)
    assert needle in str(err.value)


def test_paths_are_checked_before_anything_is_built(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["--output", str(a_file)], "model.output: cannot write to '" + str(a_file) + "': "
               + str(a_file) + " is a file"),
             (["--save", str(a_file)], "model.save: cannot write to '" + str(a_file) + "': "
              + str(a_file) + " is a file"),
             (["--load", str(a_file)], "model.load: " + str(a_file) + " is a file"),
             (["--load", str(tmp_path / "missing")], "does not exist"),
             (["--load", str(empty)], "holds no checkpoint")]
    for argv, needle in cases:
        with pytest.raises(ConfigError if "model." in needle else Exception) as err:
            _validate(argv)
        assert needle in str(err.value), argv
    # --load equal to --save: a job that restarts itself starts fresh while nothing is saved
    _validate(["--load", str(empty), "--save", str(empty)])
    _validate(["--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")])


def test_launcher_prints_the_path_error_in_one_line(tmp_path, capsys):
    """In process, as a worker would: one line, exit 2, no model built."""
    out = tmp_path / "out"
    out.write_text("not a directory")
    assert main(["--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynmo-train: error: flag --output: model.output")


def test_one_layer_per_virtual_stage_is_enough():
    """--num-layers equal to pp x virtual stages per rank is a pipeline (one layer each);
    one fewer needs a layout with empty stages."""
    flags = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    cfg = _validate(["--num-layers", "4", *flags])
    assert cfg.model.num_layers == 4
    with pytest.raises(ConfigError, match="is smaller than --pipeline-model-parallel-size"):
        _validate(["--num-layers", "3", *flags])
