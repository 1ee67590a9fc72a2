"""Bad configuration exits 2 with one line naming the file, the key and the fix."""
import subprocess
import sys

import argparse

import pytest

from dynmo_plugin.config import ConfigError, RunConfig, add_dynmo_args, add_model_args
from dynmo_plugin.megatron.training.machine import load_run_config


def _parse(argv, world_size=None):
    parser = add_dynmo_args(add_model_args(argparse.ArgumentParser()))
    return load_run_config(parser.parse_args(argv), world_size=world_size)


def _yaml(tmp_path, text):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_and_precedence(tmp_path):
    path = _yaml(tmp_path, "rebalance:\n  interval: 5\n  balancer: diffusion\nmodel:\n  num_layers: 4\n")
    cfg = _parse(["--dynmo", "--dynmo-config", path, "--dynmo-rebalance-interval", "7"])
    assert isinstance(cfg, RunConfig)
    assert cfg.dynmo.rebalance.interval == 7          # the flag wins over the file
    assert cfg.dynmo.rebalance.balancer == "diffusion"  # the file wins over the default
    assert cfg.model.num_layers == 4
    assert cfg.dynmo.profiling.window == 1


def test_forced_layouts_from_yaml_and_flag(tmp_path):
    path = _yaml(tmp_path, "rebalance:\n  forced_layouts:\n    3: 'Ett|ttttttL'\n")
    cfg = _parse(["--dynmo-config", path, "--pipeline-model-parallel-size", "2"])
    assert cfg.dynmo.rebalance.forced_layouts == {3: "Ett|ttttttL"}
    cfg = _parse(["--dynmo", "--pipeline-model-parallel-size", "2", "--dynmo-forced-layouts",
                  "2:Et|tttttttL;4:Etttt|ttttL"])
    assert cfg.dynmo.rebalance.forced_layouts == {2: "Et|tttttttL", 4: "Etttt|ttttL"}


@pytest.mark.parametrize("text,argv,needle", [
    ("rebalance:\n  intervall: 3\n", [], "rebalance.intervall: unknown key; did you mean rebalance.interval? "
                                          "expected one of"),
    ("data:\n  path: x\n", [], "data: unknown key; data is model.data; expected one of cluster, dynamism"),
    ("rebalance:\n  interval: three\n", [], "rebalance.interval: expected an integer, got 'three'"),
    ("rebalance:\n  interval: -3\n", [], "rebalance.interval: expected a non-negative number, got -3"),
    ("profiling:\n  window: 0\n", [], "profiling.window: expected a positive number, got 0"),
    ("rebalance:\n  balancer: magic\n", [], "rebalance.balancer: expected one of exact, partition"),
    ("bogus: 1\n", [], "bogus: unknown key"),
    ("- a\n- b\n", [], "expected a mapping of sections"),
    ("rebalance: [\n", [], "not valid YAML"),
    ("model: {}\n", ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
          "--pipeline-model-parallel-layout", "Ett|ttL"], "holds 4 decoder layers but --num-layers is 5"),
    ("model: {}\n", ["--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout", "Etttt|ttttL"],
     "has 2 stages but the pipeline has 3"),
    ("rebalance:\n  forced_layouts:\n    2: 'Ett|tL'\n", ["--pipeline-model-parallel-size", "2"],
     "rebalance.forced_layouts.2"),
    ("rebalance:\n  forced_layouts:\n    2: 'EttttttttL'\n", ["--pipeline-model-parallel-size", "2"],
     "fewer stages force a repack, which needs repack.enabled (--dynmo-repack)"),
    ("repack:\n  enabled: true\n  min_stages: 3\n", ["--pipeline-model-parallel-size", "2"],
     "min_stages (3) exceeds --pipeline-model-parallel-size (2)"),
    ("repack:\n  enabled: true\n  mode: checkpoint\n", [], "give --save DIR"),
    ("repack:\n  objective: fastest\n", [], "repack.objective: expected one of min_stages, throughput_per_gpu"),
    ("cluster:\n  strategy: delete-pods\n  fallback: delete-pods\n", [], "the fallback (delete-pods) is the strategy itself"),
    ("cluster:\n  strategy: scale-it\n", [], "cluster.strategy: expected one of none, statefulset-scale"),
])
def test_bad_input_is_named(tmp_path, text, argv, needle):
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        _parse(["--dynmo-config", path, *argv])
    assert needle in str(err.value)


def test_repack_and_cluster_sections(tmp_path):
    path = _yaml(tmp_path, "repack:\n  enabled: true\n  min_stages: 2\ncluster:\n  strategy: statefulset-scale\n"
                           "  namespace: ml\n")
    cfg = _parse(["--dynmo", "--dynmo-config", path, "--pipeline-model-parallel-size", "4",
                  "--dynmo-repack-objective", "throughput_per_gpu", "--dynmo-cluster-retries", "2",
                  "--dynmo-forced-layouts", "5:Etttt|ttttL"])
    rp, cl = cfg.dynmo.repack, cfg.dynmo.cluster
    assert (rp.enabled, rp.min_stages, rp.objective, rp.mode) == (True, 2, "throughput_per_gpu", "live")
    assert (cl.strategy, cl.namespace, cl.retries, cl.fallback) == ("statefulset-scale", "ml", 2, "none")


def test_manual_gc_interval_needs_manual_gc():
    with pytest.raises(ConfigError, match="--manual-gc-interval 5 does nothing without --manual-gc"):
        _parse(["--manual-gc-interval", "5"])
    m = _parse(["--manual-gc", "--manual-gc-interval", "5"]).model
    assert (m.manual_gc, m.manual_gc_interval) == (True, 5)
    assert not _parse([]).model.manual_gc


def test_world_shape_checked():
    with pytest.raises(ConfigError, match="not a multiple of TP"):
        _parse(["--pipeline-model-parallel-size", "3"], world_size=4)
    with pytest.raises(ConfigError, match="global-batch-size"):
        _parse(["--global-batch-size", "6", "--micro-batch-size", "2"], world_size=2)


@pytest.mark.parametrize("argv,needle", [
    (["--dynmo-config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml: cannot read the config file"),
    (["--dynmo-rebalance-interval", "-3"], "flag --dynmo-rebalance-interval: rebalance.interval: expected a non-negative number, got -3"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tttttL"],
     "holds 6 decoder layers but --num-layers is 4"),
])
def test_launcher_exits_2_with_one_line(argv, needle):
    proc = subprocess.run([sys.executable, "-m", "dynmo_plugin.train", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_megatron_lm_args_namespace_is_read_directly():
    """Megatron-LM's parsed args use the same destinations; extra attributes are ignored."""
    class ParsedLayout:  # stands for Megatron-LM's PipelineParallelLayerLayout after validate_args
        def __repr__(self):
            return "Ett|ttL"

    parser = add_dynmo_args(argparse.ArgumentParser())
    args = parser.parse_args(["--dynmo", "--dynmo-rebalance-interval", "50"])
    args.num_layers, args.pipeline_model_parallel_size = 4, 2
    args.pipeline_model_parallel_layout = ParsedLayout()
    args.micro_batch_size, args.global_batch_size, args.save = 1, 8, "/ckpt"
    cfg = load_run_config(args, world_size=2)
    assert cfg.dynmo.enabled and cfg.dynmo.rebalance.interval == 50
    assert cfg.model.num_layers == 4 and cfg.model.pipeline_model_parallel_layout == "Ett|ttL"
