"""The stage contract (dynmo_plugin.stage.StageHandle): both stages implement every member.

The launcher's StageTrainer and the Megatron-LM integration's MegatronLMStage are checked
member by member against the protocol (a value or a method, a writable value, a
method's parameters), statically from their classes; the launcher's stage also live, in
one gloo rank. The checker itself is shown to catch a missing member and a changed
signature.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import textwrap

import pytest

from launch import in_megatron_process

from dynmo_plugin.stage import STAGE_MEMBERS, ModelFlags, StageDims, StageHandle

_MISSING = object()


def _assigned_on_self(cls: type) -> set[str]:
    """Attributes the methods of the class and its bases assign on `self`."""
    names: set[str] = set()
    methods = [f for klass in cls.__mro__[:-1] for f in vars(klass).values()
               if inspect.isfunction(f)]
    for node in (n for f in methods for n in ast.walk(ast.parse(textwrap.dedent(
            inspect.getsource(f))))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id == "self":
                    names.add(t.attr)
    return names


def _params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def contract_problems(cls: type, protocol: type = StageHandle) -> list[str]:
    """Every way `cls` misses `protocol`'s members: absent, a method where a value is
    due (or the reverse), read-only where the protocol writes, other parameters."""
    assigned, problems = _assigned_on_self(cls), []
    for name in (n for n in vars(protocol) if not n.startswith("_")):
        want, have = vars(protocol)[name], inspect.getattr_static(cls, name, _MISSING)
        if isinstance(want, property):
            if have is _MISSING and name not in assigned:
                problems.append(f"{name}: missing")
            elif inspect.isfunction(have):
                problems.append(f"{name}: a method, the contract has a value")
            elif want.fset is not None and isinstance(have, property) and have.fset is None:
                problems.append(f"{name}: read-only, the contract sets it")
        elif not inspect.isfunction(have):
            problems.append(f"{name}: {'missing' if have is _MISSING else 'not a method'}")
        elif _params(have) != _params(want):
            problems.append(f"{name}{inspect.signature(have)}: the contract has "
                            f"{name}{inspect.signature(want)}")
    return problems


def _stage_classes() -> dict[str, type]:
    from dynmo_plugin.integrations.megatron_lm import MegatronLMStage
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    return {"StageTrainer": StageTrainer, "MegatronLMStage": MegatronLMStage}


@pytest.mark.parametrize("name", ["StageTrainer", "MegatronLMStage"])
def test_both_stages_implement_every_member(name):
    assert contract_problems(_stage_classes()[name]) == []


def test_every_member_says_why_it_exists():
    assert len(STAGE_MEMBERS) >= 12
    members = vars(StageHandle)
    undocumented = [n for n in STAGE_MEMBERS if not (members[n].__doc__ or "").strip()]
    assert undocumented == []
    typed = [n for n in STAGE_MEMBERS if "return" not in inspect.get_annotations(
        members[n].fget if isinstance(members[n], property) else members[n])]
    assert typed == []


class _Complete:
    """Every member, the simplest way (for the checker's own test)."""

    def __init__(self):
        self.dims = self.layout = self.args = self.config = self.spec = None
        self.chunks, self.model, self.scheduler = [], None, None

    layers = ddps = optimizer = num_microbatches = peak_microbatches = property(lambda self: [])

    def build_ddp(self, chunk: int = 0):
        pass

    def build_optimizer(self, ddp):
        pass

    def install_wrappers(self, ddp, optimizer) -> None:
        pass


def test_the_check_finds_a_missing_member_and_a_changed_signature():
    assert contract_problems(_Complete) == []
    no_ddps = type("NoDdps", (), {k: v for k, v in vars(_Complete).items() if k != "ddps"})
    assert contract_problems(no_ddps) == ["ddps: missing"]

    class NoDefault(_Complete):
        def build_ddp(self, chunk: int):
            pass

    class ReadOnlyLayout(_Complete):
        layout = property(lambda self: None)

    class MethodScheduler(_Complete):
        def scheduler(self):
            pass

    assert contract_problems(NoDefault) == ["build_ddp(self, chunk: 'int'): the contract has "
                                            "build_ddp(self, chunk: 'int' = 0) -> 'DDP'"]
    assert contract_problems(ReadOnlyLayout) == ["layout: read-only, the contract sets it"]
    assert contract_problems(MethodScheduler) == ["scheduler: a method, the contract has a value"]
    assert isinstance(_Complete(), StageHandle) and not isinstance(object(), StageHandle)


def test_parallel_dims_and_model_args_carry_what_the_contract_reads():
    from dynmo_plugin.config import ModelArgs
    from dynmo_plugin.megatron.training.parallel import ParallelDims

    for cls, protocol in ((ParallelDims, StageDims), (ModelArgs, ModelFlags)):
        fields = {f.name for f in dataclasses.fields(cls)}
        wanted = [n for n in vars(protocol) if not n.startswith("_")]
        wanted += list(inspect.get_annotations(protocol))
        absent = [n for n in wanted if n not in fields and not hasattr(cls, n)]
        assert absent == [], f"{cls.__name__} lacks {absent}"


def test_the_contract_sits_on_the_ground_floor():
    """stage.py imports only the standard library and the pure ground-floor modules."""
    import dynmo_plugin.stage as stage
    tree = ast.parse(inspect.getsource(stage))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "typing", "dynmo_plugin.layout", "dynmo_plugin.errors"}
    code = ("import sys, dynmo_plugin.stage; "
            "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _check_live_launcher_stage(args):
    """In a one-rank gloo world: the built StageTrainer, its dims and args are what the
    contract says, and `current_dims` (the one builder of ParallelDims) reads the world
    init_parallel made."""
    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import current_dims
    from dynmo_plugin.megatron.training.trainer import StageTrainer

    dims = current_dims()
    assert (dims.rank, dims.world_size, dims.tp, dims.pp, dims.dp, dims.pp_rank, dims.dp_rank) \
        == (0, 1, 1, 1, 1, 0, 0)
    trainer = StageTrainer(args, dims, Layout.uniform(args.num_layers, 1))
    assert isinstance(trainer, StageHandle)
    assert isinstance(trainer.dims, StageDims) and isinstance(trainer.args, ModelFlags)
    assert len(trainer.layers) == args.num_layers and len(trainer.ddps) == len(trainer.chunks) == 1
    assert trainer.num_microbatches == trainer.peak_microbatches == args.global_batch_size // args.micro_batch_size


def test_a_live_launcher_stage_is_a_stage_handle():
    in_megatron_process(_check_live_launcher_stage)


def _built_in(name: str) -> set[str]:
    """The modules of dynmo_plugin whose code calls `name(...)` (constructs it)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    found = set()
    for path in (root / "dynmo_plugin").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            func = getattr(node, "func", None)
            if isinstance(node, ast.Call) and name in (getattr(func, "id", None),
                                                       getattr(func, "attr", None)):
                found.add(path.relative_to(root).as_posix())
    return found


def test_one_place_builds_the_controller_and_one_the_parallel_dims():
    """The launcher's session and the Megatron-LM run both get their controller from
    assembly.assemble and their ParallelDims from megatron.parallel.current_dims."""
    assert _built_in("DynMo") == {"dynmo_plugin/assembly.py"}
    assert _built_in("ParallelDims") == {"dynmo_plugin/megatron/training/parallel.py"}
    assert _built_in("assemble") == {"dynmo_plugin/session.py",
                                     "dynmo_plugin/integrations/megatron_lm.py"}
