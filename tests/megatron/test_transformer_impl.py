"""--transformer-impl local|transformer_engine (Megatron's spelling) and carrying a
layer's `_extra_state` (TE's fp8 metadata) through a migration.

Transformer Engine cannot be installed on the CPU machines this suite runs on, so the
TE side is tested through the resolver's inputs (GPU count, whether TE imports) and a
stand-in module that writes extra state the ways TE versions do; the real TE path is
unverified until a GPU run (scripts/gpu_check.sh).
"""
from __future__ import annotations

import io

import pytest
import torch

from dynmo_plugin.config import ConfigError, resolve_transformer_impl
from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.megatron.training.machine import transformer_engine_problem
from dynmo_plugin.megatron.migration.extra_state import ExtraStateError, carried_state, loadable_state
from dynmo_plugin.migration.wire import pack, unpack
from dynmo_plugin.train import build_parser, main

no_cuda = pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the CPU-only default")


def _te_ok():
    return None


def _te_missing():
    return "ModuleNotFoundError: No module named 'transformer_engine'"


def _never():
    raise AssertionError("whether TE imports does not matter here and must not be asked")


# ---- the resolver: defaults and refusals for every machine shape -------------------------
@pytest.mark.parametrize("requested, gpus, scenario, te, impl, note", [
    (None, 0, "none", _never, "local", None),                 # CPU: local, TE never imported
    ("local", 8, "none", _never, "local", None),
    (None, 8, "none", _te_ok, "transformer_engine", None),     # GPUs + TE: TE by default
    (None, 8, "moe", _te_ok, "transformer_engine", None),
    (None, 8, "none", _te_missing, "local", "does not import (ModuleNotFoundError"),
    (None, 8, "gradual_pruning", _te_ok, "local", "scenario gradual_pruning: its masked linears"),
    (None, 8, "early_exit", _te_ok, "local", "scenario early_exit"),
    ("transformer_engine", 8, "none", _te_ok, "transformer_engine", None),
    ("transformer_engine", 8, "layer_freezing", _te_ok, "transformer_engine", None),
])
def test_resolver_picks_the_implementation(requested, gpus, scenario, te, impl, note):
    got, said = resolve_transformer_impl(requested, gpus, scenario, te)
    assert got == impl
    assert (said is None) if note is None else (note in said)


@pytest.mark.parametrize("gpus, scenario, te, message", [
    (0, "none", _never, "flag --transformer-impl: transformer_engine needs CUDA GPUs and none "
                        "is visible here; use --transformer-impl local"),
    (8, "none", _te_missing, "transformer_engine does not import here (ModuleNotFoundError: No "
                             "module named 'transformer_engine'); install it (pip install -c "
                             "constraints.txt 'transformer-engine[pytorch]'"),
    (8, "sparse_attention", _never, "cannot build the sparse_attention scenario's layers"),
    (8, "mixture_of_depths", _never, "cannot build the mixture_of_depths scenario's layers"),
])
def test_transformer_engine_that_cannot_work_is_refused(gpus, scenario, te, message):
    with pytest.raises(ConfigError) as e:
        resolve_transformer_impl("transformer_engine", gpus, scenario, te, "flag --transformer-impl")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_local_only_scenarios_are_real_scenarios():
    from dynmo_plugin.scenarios import SCENARIOS
    local_only = {name for name, e in SCENARIOS.items() if e.local_only}
    assert local_only == {"gradual_pruning", "early_exit", "mixture_of_depths", "sparse_attention"}
    # moe picks TE's MoE spec itself; freezing wraps the layer class: both keep TE layers
    assert {"moe", "layer_freezing"}.isdisjoint(local_only)


# ---- the flag through the real config and launcher (this machine: no GPU, no TE) ---------
@no_cuda
def test_flag_default_and_choices_on_cpu():
    parse = build_parser().parse_args
    assert load_run_config(parse([])).model.transformer_impl == "local"
    assert load_run_config(parse(["--transformer-impl", "local"])).model.transformer_impl == "local"
    with pytest.raises(ConfigError, match="transformer_impl: expected one of local, "
                                          "transformer_engine, got 'te'"):
        load_run_config(parse(["--transformer-impl", "te"]))


@no_cuda
def test_launcher_refuses_transformer_engine_without_cuda_in_one_line(capsys, tmp_path):
    assert main(["--transformer-impl", "transformer_engine", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("dynmo-train: error: flag --transformer-impl: transformer_engine needs CUDA "
                   "GPUs and none is visible here; use --transformer-impl local (the default "
                   "without GPUs)")
    yaml_file = tmp_path / "te.yaml"
    yaml_file.write_text("model:\n  transformer_impl: transformer_engine\n")
    with pytest.raises(ConfigError, match=f"^{yaml_file}: model.transformer_impl: "
                                          "transformer_engine needs CUDA GPUs"):
        load_run_config(build_parser().parse_args(["--dynmo-config", str(yaml_file)]))


@pytest.mark.skipif(transformer_engine_problem() is None, reason="TE imports here")
def test_transformer_engine_problem_names_the_import_failure():
    assert transformer_engine_problem().startswith(("ModuleNotFoundError", "ImportError", "OSError"))


def test_layer_spec_builds_what_was_resolved():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from dynmo_plugin.megatron.training.model import layer_spec
    qkv = layer_spec("local").submodules.self_attention.submodules.linear_qkv
    assert qkv is ColumnParallelLinear
    with pytest.raises(ValueError, match="transformer_impl 'te': expected local or transformer_engine"):
        layer_spec("te")
    if torch.cuda.device_count() == 0:
        assert layer_spec(None).submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear


# ---- extra state through the migration wire ----------------------------------------------
class StandInTeLinear(torch.nn.Module):
    """Stand-in for a Transformer Engine module (TE is not installable here): a weight
    plus extra state in the form `kind` gives, as TE versions write it."""

    def __init__(self, kind: str, payload: bytes = b""):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))
        self.kind, self.payload, self.loaded = kind, payload, "never"

    def get_extra_state(self):
        if self.kind == "tensor":   # TE >= 1.x: pickled fp8 metadata as uint8
            return torch.frombuffer(bytearray(self.payload), dtype=torch.uint8)
        if self.kind == "bytesio":  # older TE: torch.save into a BytesIO
            return io.BytesIO(self.payload)
        if self.kind == "empty":    # TE without fp8: an empty tensor
            return torch.empty(0, dtype=torch.uint8)
        return {"none": None, "dict": {"amax": 1.0}}[self.kind]

    def set_extra_state(self, state):
        if isinstance(state, io.BytesIO):
            self.loaded = ("bytesio", state.getvalue())
        else:
            self.loaded = ("tensor", state.numpy().tobytes())


class StandInLayer(torch.nn.Module):
    def __init__(self, kind: str, payload: bytes = b""):
        super().__init__()
        self.layer_number = 3
        self.linear_fc1 = StandInTeLinear(kind, payload)


def _through_the_wire(tensors: dict) -> dict:
    header, buffers = pack(3, 0, 1, {**tensors, "grad/x": torch.ones(2)}, torch.device("cpu"))
    return unpack(header, [b.clone() for b in buffers])


@pytest.mark.parametrize("kind", ["tensor", "bytesio"])
def test_extra_state_arrives_as_the_module_wrote_it(kind):
    payload = bytes(range(256)) * 3 + b"fp8 amax history"
    src = StandInLayer(kind, payload)
    received = loadable_state(_through_the_wire(carried_state(src)))
    assert set(received) == {"linear_fc1.weight", "linear_fc1._extra_state"}
    dst = StandInLayer("none")
    missing, unexpected = dst.load_state_dict(received, strict=False)
    assert missing == [] and unexpected == []
    assert dst.linear_fc1.loaded == (kind, payload)
    assert torch.equal(dst.linear_fc1.weight, src.linear_fc1.weight)


@pytest.mark.parametrize("kind", ["none", "empty"])
def test_extra_state_with_nothing_in_it_is_not_sent(kind):
    tensors = carried_state(StandInLayer(kind))
    assert set(tensors) == {"state/linear_fc1.weight"}
    dst = StandInLayer("none")
    missing, _ = dst.load_state_dict(loadable_state(tensors), strict=False)
    assert missing == ["linear_fc1._extra_state"] and dst.linear_fc1.loaded == "never"


def test_extra_state_of_another_kind_is_refused_by_name():
    with pytest.raises(ExtraStateError, match=r"layer 3: linear_fc1._extra_state is a dict; a "
                                              r"migration carries extra state only as a tensor"):
        carried_state(StandInLayer("dict"))
