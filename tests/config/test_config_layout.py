"""The configuration as a package (issue 26, item 3): a pure schema, names taken from
their owners, and one repack min_stages guard for every entry point."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dynmo_plugin.balancing import GateConfig, RepackCriteria
from dynmo_plugin.balancing.decide import decide
from dynmo_plugin.balancing.repack import OBJECTIVES
from dynmo_plugin.balancing.profile_problem import problem_from_profile
from dynmo_plugin.balancing.solve import BALANCERS
from dynmo_plugin.cluster.release import STRATEGIES
from dynmo_plugin.cli._from_run import recommend
from dynmo_plugin.config import (BALANCER_NAMES, CLUSTER_STRATEGIES, ConfigError, DynmoConfig,
                                 RepackConfig, RunConfig, add_dynmo_args, add_model_args,
                                 load_config)
from dynmo_plugin.controller import DynMo
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "dynmo_plugin" / "config"
HEAVY = ("torch", "megatron", "transformer_engine")

_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(sys.modules)))
"""


# ---- a pure schema ----------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["dynmo_plugin.config.schema", "dynmo_plugin.config"])
def test_config_imports_no_torch_or_megatron(module):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert not [m for m in loaded if m.split(".")[0] in HEAVY], module
    assert "dynmo_plugin.megatron.training.machine" not in loaded  # probed only when load_config asks


def _module_imports(path: Path) -> set[str]:
    """What `path` imports at module level (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_schema_modules_read_no_file_and_import_only_pure_parts():
    pure = {"__future__", "dataclasses", "typing", "dynmo_plugin.errors", "dynmo_plugin.config.fields",
            "dynmo_plugin.scenarios", "dynmo_plugin.balancing.solve", "dynmo_plugin.balancing.grow",
            "dynmo_plugin.balancing.repack", "dynmo_plugin.cluster.release"}
    for path in (CONFIG / "fields.py", CONFIG / "schema.py",
                 *sorted(CONFIG.parent.glob("scenarios/*/config.py"))):
        assert _module_imports(path) <= pure, path


def test_no_config_module_imports_megatron_at_module_level():
    paths = sorted(CONFIG.glob("*.py"))
    assert {p.stem for p in paths} >= {"__init__", "fields", "schema", "flags", "checks", "load"}
    for path in paths:
        bad = {m for m in _module_imports(path)
               if m.split(".")[0] in HEAVY or m.startswith("dynmo_plugin.megatron")}
        assert not bad, (path.name, bad)


# ---- names from their owners ------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    return add_dynmo_args(add_model_args(argparse.ArgumentParser()))


def _cfg(*argv: str) -> RunConfig:
    return load_config(_parser().parse_args(["--dynmo", *argv]), cuda_devices=lambda: 0, te_problem=lambda: None)


def test_balancer_names_are_the_solvers_registry():
    assert BALANCER_NAMES is BALANCERS
    for name in BALANCERS:
        assert _cfg("--dynmo-balancer", name).dynmo.rebalance.balancer == name
    with pytest.raises(ConfigError, match=f"expected one of {', '.join(BALANCERS)}, got 'fastest'$"):
        _cfg("--dynmo-balancer", "fastest")


def test_cluster_strategies_and_repack_defaults_are_their_owners():
    assert CLUSTER_STRATEGIES is STRATEGIES
    assert RepackCriteria.from_config(RepackConfig()) == RepackCriteria()


def test_repack_objectives_are_the_planners():
    for name in OBJECTIVES:
        assert _cfg("--dynmo-repack-objective", name).dynmo.repack.objective == name
    with pytest.raises(ConfigError, match=f"expected one of {', '.join(OBJECTIVES)}, got 'fastest'$"):
        _cfg("--dynmo-repack-objective", "fastest")


def test_load_config_asks_the_machine_it_is_given_and_only_last():
    asked, parser = [], _parser()

    def gpus():
        asked.append("gpus")
        return 0
    cfg = load_config(parser.parse_args([]), cuda_devices=gpus, te_problem=lambda: "never asked")
    assert (cfg.model.transformer_impl, asked) == ("local", ["gpus"])
    asked.clear()
    with pytest.raises(ConfigError, match="--hidden-size"):  # a bad value fails before any probe
        load_config(parser.parse_args(["--hidden-size", "65"]), cuda_devices=gpus,
                    te_problem=lambda: "never asked")
    assert asked == []


# ---- one min_stages guard ---------------------------------------------------------------------
_GUARD = re.compile(r"num_ranks\s*(<=|>=|<|>)\s*[\w.\[\]\"()]*min_stages")


def test_the_min_stages_guard_is_written_once():
    """balancing/repack.py's planners keep their own "nothing to consider" answer; the
    entry points (live controller, decide, dynmo plan --from-run) share one predicate."""
    hits = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "dynmo_plugin").rglob("*.py"))
            if p.name != "repack.py" or p.parent.name != "balancing"
            for n, line in enumerate(p.read_text().splitlines(), 1) if _GUARD.search(line)]
    assert len(hits) == 1 and hits[0].startswith("dynmo_plugin/balancing/decide.py"), hits


def _profile() -> PipelineProfile:
    """8 light layers on 2 stages: one stage is fast enough when the slowdown is free."""
    layers = [LayerProfile(layer=n, stage=(n - 1) // 4, fwd_s=0.01, bwd_s=0.02, param_bytes=10**5,
                           grad_bytes=10**5, optim_bytes=2 * 10**5, act_bytes=10**4)
              for n in range(1, 9)]
    stages = [StageProfile(stage=s, extra_s=0.005, wait_s=0.0, peak_bytes=0, num_microbatches=8)
              for s in range(2)]
    return PipelineProfile(layers, stages)


def _controller_considers(min_stages: int) -> bool:
    config = DynmoConfig(enabled=True, repack=RepackConfig(enabled=True, min_stages=min_stages,
                                                           max_slowdown=100.0))
    me = types.SimpleNamespace(config=config, _repacker=object())
    return functools.partial(DynMo._repack_criteria, me)(_problem(), "start") is not None


def _problem():
    return problem_from_profile(_profile(), Layout((4, 4)), DynmoConfig(), 8)


def _decide_considers(min_stages: int) -> bool:
    gate = GateConfig(iterations_until_next_event=100, bandwidth_bytes_per_s=1e9)
    choice = decide(_problem(), "exact", gate,
                    RepackCriteria(min_stages=min_stages, max_slowdown=100.0))
    return choice.repack is not None


def _from_run_considers(min_stages: int, run_dir: Path) -> bool:
    cfg = RunConfig()
    cfg.model.pipeline_model_parallel_size = 2
    cfg.dynmo.repack = RepackConfig(enabled=True, min_stages=min_stages, max_slowdown=100.0)
    event = {"kind": "rebalance", "trigger": "start", "iteration": 1,
             "layout_before": "Etttt|ttttL", "profile": _profile().to_dict()}
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps({"config": dataclasses.asdict(cfg),
                                                     "world": {"dp": 1}, "events": [event]}))
    return recommend(str(run_dir))["pipeline_model_parallel_size"] == 1


def test_every_entry_point_considers_a_repack_only_above_min_stages(tmp_path):
    for min_stages, considered in ((1, True), (2, False)):
        assert _controller_considers(min_stages) is considered
        assert _decide_considers(min_stages) is considered
        assert _from_run_considers(min_stages, tmp_path / f"min{min_stages}") is considered
