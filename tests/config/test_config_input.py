"""Bad input found before any process group exists, each as one line naming the key
in dotted form and the fix (issue 28: each of these traced back or was accepted)."""
from __future__ import annotations

import os
import threading

import pytest

from dynmo_plugin.config import ConfigError
from dynmo_plugin.errors import UserError
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


def test_exponent_floats_read_as_numbers_as_on_the_command_line(tmp_path):
    """YAML 1.1 (PyYAML's default) reads `3e-4` as a string: a learning rate written as on
    the command line failed 'expected a number'. Integers, dotted floats and what is no
    number at all keep their meaning."""
    text = "model:\n  lr: 3e-4\n  min_lr: 1E-5\n  num_layers: 8\nrebalance:\n  min_gain: 5e-2\n"
    cfg = _validate(["--dynmo-config", _yaml(tmp_path, text)])
    assert (cfg.model.lr, cfg.model.min_lr, cfg.model.num_layers, cfg.dynmo.rebalance.min_gain) == (3e-4, 1e-5, 8, 0.05)
    with pytest.raises(ConfigError, match="model.lr: expected a number, got '3e'"):
        _validate(["--dynmo-config", _yaml(tmp_path, "model:\n  lr: 3e\n")])
    with pytest.raises(ConfigError, match="model.num_layers: expected an integer, got 1000.0"):
        _validate(["--dynmo-config", _yaml(tmp_path, "model:\n  num_layers: 1e3\n")])


def test_a_save_directory_of_an_earlier_run_is_refused_unless_this_run_resumes_it(tmp_path):
    """A fresh run whose --save holds an earlier run's checkpoints overwrote them one by
    one and moved the tracker back: refused in one line; resuming that directory, or a
    --save with no checkpoint yet, is fine. The checkpoint itself is not read here."""
    earlier = tmp_path / "ckpt"
    earlier.mkdir()
    (earlier / "latest_checkpointed_iteration.txt").write_text("4")
    fresh = tmp_path / "fresh"
    with pytest.raises(UserError) as err:
        _validate(["--save", str(earlier), "--save-interval", "2"])
    assert str(err.value) == (f"--save {earlier} already holds an earlier run's checkpoints (iteration 4), "
                              f"which this run would overwrite; resume that run with --load {earlier}, or "
                              "give another --save")
    with pytest.raises(UserError, match="already holds an earlier run's checkpoints"):
        _validate(["--save", str(earlier), "--load", str(fresh)])
    _validate(["--save", str(fresh), "--save-interval", "2"])
    from dynmo_plugin.megatron.checkpoint.directory import check_save_is_this_runs
    check_save_is_this_runs(str(earlier), str(tmp_path / "." / "ckpt"))  # resumes it


def test_a_job_that_restarts_itself_starts_fresh_however_its_directory_is_spelled(tmp_path, monkeypatch):
    """--load ./ckpt --save ckpt on the first start: nothing saved yet, so it starts from
    scratch as --load ckpt --save ckpt does (the comparison was of the strings)."""
    monkeypatch.chdir(tmp_path)
    _validate(["--load", "./ckpt", "--save", "ckpt", "--save-interval", "2"])
    with pytest.raises(UserError, match="the directory does not exist"):
        _validate(["--load", "./other", "--save", "ckpt"])


@pytest.mark.parametrize("key", ["1e400", "1e3", "2.5", "-3", "true", "²"])
def test_forced_layout_iterations_are_whole_numbers(tmp_path, key):
    """A YAML key that reads as a float (1e400 is inf: int() raised OverflowError, a
    traceback) or a bool is not an iteration; the line says what is."""
    text = f"rebalance:\n  forced_layouts: {{{key}: 'Etttt|ttttL'}}\n"
    with pytest.raises(ConfigError, match="integer iterations as keys|positive iterations") as err:
        _validate(["--dynmo-config", _yaml(tmp_path, text)])
    assert "\n" not in str(err.value)


def test_a_directory_as_config_is_named(tmp_path):
    with pytest.raises(ConfigError, match="it is a directory; give the YAML file"):
        _validate(["--dynmo-config", str(tmp_path)])


def test_a_config_that_never_ends_is_refused_and_a_pipe_is_read(tmp_path):
    """/dev/zero as the config read forever; a pipe (`--dynmo-config <(...)`) is a
    YAML file like any other."""
    with pytest.raises(ConfigError, match="/dev/zero: larger than 1 MiB, not a config file"):
        _validate(["--dynmo-config", "/dev/zero"])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_text, args=("rebalance:\n  interval: 3\n",))
    writer.start()
    assert _validate(["--dynmo-config", str(fifo)]).dynmo.rebalance.interval == 3
    writer.join()


def test_a_start_profile_past_the_run_names_a_fix_that_fits():
    """The window alone longer than the run: the start it suggested (1) was refused too."""
    with pytest.raises(ConfigError, match=r"ends past --train-iters \(2\): .*; give --dynmo-start-balanced-at <= 1 "):
        _validate(["--dynmo", "--dynmo-start-balanced-at", "2", "--dynmo-profile-window", "2", "--train-iters", "2"])
    with pytest.raises(ConfigError, match=r"; give --dynmo-profile-window <= 2 or more --train-iters$"):
        _validate(["--dynmo", "--dynmo-start-balanced-at", "1", "--dynmo-profile-window", "4", "--train-iters", "2"])
    _validate(["--dynmo", "--dynmo-start-balanced-at", "1", "--dynmo-profile-window", "2", "--train-iters", "2"])


@pytest.mark.parametrize("argv,needle", [
    (["--seq-length", "32", "--max-position-embeddings", "8"],
     "model.seq_length (32) exceeds model.max_position_embeddings (8)"),
    (["--lr", "inf"], "flag --lr: model.lr: expected a finite number, got inf"),
    (["--dynmo-gate-margin", "inf"], "rebalance.margin: expected a finite number"),
    # past 64 bits torch's seeding and numpy overflowed on every rank
    (["--seed", str(2**64)], "flag --seed: model.seed: expected an integer of 64 bits (below 2**63)"),
    (["--num-layers", "9" * 23], "model.num_layers: expected an integer of 64 bits"),
    # 64 bits, but each layer a module and a layout character: MemoryError on every rank
    (["--num-layers", str(2**62)], "model.num_layers: expected a positive number of at most 1048576 (2**20) layers"),
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
             (["--load", str(empty)], "holds no checkpoint"),
             # writable by its bits, but procfs makes no directory (it died in the report)
             (["--output", "/proc/dynmo-x"], "model.output: cannot write to '/proc/dynmo-x': /proc refuses a "
              "new directory (")]
    for argv, needle in cases:
        with pytest.raises(ConfigError if "model." in needle else Exception) as err:
            _validate(argv)
        assert needle in str(err.value), argv
    # --load equal to --save: a job that restarts itself starts fresh while nothing is saved
    _validate(["--load", str(empty), "--save", str(empty)])
    _validate(["--load", str(tmp_path / "new"), "--save", str(tmp_path / "new")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "f"]  # the probes left nothing


def test_a_kubeconfig_is_read_before_training(tmp_path):
    """--dynmo-cluster-kubeconfig is read at the start, not at the first release (which
    logged the failure and trained on holding GPUs it could not give back)."""
    good = tmp_path / "kc"
    good.write_text("apiVersion: v1\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
                    "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
                    "current-context: x\n")
    flags = ["--dynmo", "--dynmo-cluster-strategy", "statefulset-scale", "--dynmo-cluster-kubeconfig"]
    _validate([*flags, str(good)])
    no_context = tmp_path / "no_context"
    no_context.write_text(good.read_text().replace("current-context: x\n", ""))
    other = tmp_path / "other_cluster"
    other.write_text(good.read_text().replace("cluster: c, user", "cluster: d, user"))
    no_ca = tmp_path / "no_ca"
    no_ca.write_text(good.read_text().replace("server: 'https://127.0.0.1:1'",
                                              "server: 'https://127.0.0.1:1', certificate-authority: ca.crt"))
    for path, needle in ((tmp_path / "missing", "flag --dynmo-cluster-kubeconfig: kubeconfig " + str(tmp_path / "missing")
                          + " does not exist; give the kubeconfig file, or leave it out"),
                         (no_context, "no_context (flag --dynmo-cluster-kubeconfig): has no current-context"),
                         (other, "context 'x' names cluster 'd', which the file does not hold"),
                         (no_ca, "its cluster's certificate-authority ca.crt does not exist")):
        with pytest.raises(ConfigError) as err:
            _validate([*flags, str(path)])
        assert needle in str(err.value), str(err.value)
    (tmp_path / "ca.crt").write_text("x")  # relative to the kubeconfig, as kubectl reads it
    _validate([*flags, str(no_ca)])
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=f"kubeconfig {dangling} is a symbolic link to {tmp_path / 'gone'}, "
                                          "which does not exist; give the kubeconfig file$"):
        _validate([*flags, str(dangling)])
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(good.read_text())
    with pytest.MonkeyPatch.context() as mp:  # `~` expanded, as the kubernetes client does
        mp.setenv("HOME", str(home))
        _validate([*flags, "~/.kube/config"])


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


def test_save_without_an_interval_warns_that_nothing_is_saved(tmp_path):
    """Megatron-LM requires --save-interval with --save; here 0 means 'only a checkpoint
    repack saves', so a plain run given --save alone wrote nothing, silently."""
    notices = _validate(["--save", str(tmp_path / "a")]).notices
    assert [n for n in notices if "--save-interval is 0: nothing is saved" in n] == [
        "flag --save: --save-interval is 0: nothing is saved (only a checkpoint repack or a signal with "
        "--exit-signal-handler saves then); give --save-interval N to save every N iterations and the last, "
        "as Megatron-LM does"]
    for more in (["--save-interval", "5"], ["--exit-signal-handler"]):  # (the resume line advises the latter)
        assert not any("--save-interval" in n for n in _validate(["--save", str(tmp_path / "b"), *more]).notices)

