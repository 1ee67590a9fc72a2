"""The package's floors: who may import whom (docs/architecture.md, "Floors").

Read from the source (ast), so a lazy import inside a function counts like a module-level
one: a dependency is a dependency wherever it is written. Imports under
`if TYPE_CHECKING:` are annotations only: they do not count for the floors, but they do
for circles (two modules naming each other cannot be read one without the other).
Every module also stays at or under MAX_LINES lines.
"""
from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dynmo_plugin"

# Bottom to top. A module may import modules of its own floor or below, never above.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("dynmo_plugin", "dynmo_plugin.errors", "dynmo_plugin.layout", "dynmo_plugin.report",
                "dynmo_plugin.stage", "dynmo_plugin.faults")),
    ("records", ("dynmo_plugin.profiling*", "dynmo_plugin.migration*", "dynmo_plugin.scenarios",
                 "dynmo_plugin.scenarios.base", "dynmo_plugin.scenarios.flops",
                 "dynmo_plugin.scenarios.gathered_tokens", "dynmo_plugin.scenarios.shapes",
                 "dynmo_plugin.scenarios.*.config",
                 "dynmo_plugin.scenarios.*.kernels", "dynmo_plugin.config.fields")),
    ("pure wings", ("dynmo_plugin.balancing*", "dynmo_plugin.sim*", "dynmo_plugin.reporting*",
                    "dynmo_plugin.config*", "dynmo_plugin.scenarios.*.cost", "dynmo_plugin.data*",
                    "dynmo_plugin.cluster*")),
    ("runtime", ("dynmo_plugin.megatron*", "dynmo_plugin.consensus", "dynmo_plugin.releases",
                 "dynmo_plugin.events", "dynmo_plugin.decision_lines")),
    ("scenario parts", ("dynmo_plugin.scenarios.*.live", "dynmo_plugin.scenarios.*.layer",
                        "dynmo_plugin.scenarios.*")),
    ("run", ("dynmo_plugin.controller", "dynmo_plugin.session", "dynmo_plugin.assembly",
             "dynmo_plugin.train", "dynmo_plugin.torchrun_check", "dynmo_plugin.integrations*",
             "dynmo_plugin.cli*")),
]
# Where Megatron-Core itself may be imported: the adapter floor, a scenario's live part
# and layers, and the Megatron-LM integration.
MEGATRON_ALLOWED = ("dynmo_plugin.megatron*", "dynmo_plugin.scenarios.*.live",
                    "dynmo_plugin.scenarios.*.layer", "dynmo_plugin.integrations*")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    """The first floor (bottom up) with a pattern matching `module`; exact names first."""
    for exact in (True, False):
        for i, (_, patterns) in enumerate(FLOORS):
            for pattern in patterns:
                if (pattern == module) if exact else fnmatch.fnmatchcase(module, pattern):
                    return i
    raise AssertionError(f"{module} is on no floor: add it to FLOORS")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(module: str, annotations: bool = False) -> set[str]:
    """Every dynmo_plugin module and third-party top-level package `module` imports
    (with `annotations`, those under `if TYPE_CHECKING:` too)."""
    tree = ast.parse(MODULES[module].read_text())
    skip, found = set() if annotations else _type_checking_nodes(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` depends on mod (pkg's __init__ runs first anyway, as
            # for every import of a submodule); `from pkg import name` on pkg
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{module}: relative import; write dynmo_plugin.… in full")
    return found


GRAPH = {m: {i for i in imports(m) if i in MODULES and i != m} for m in MODULES}
# For circles: every module-level, lazy and `if TYPE_CHECKING:` import between modules.
NAMED = {m: {i for i in imports(m, annotations=True) if i in MODULES and i != m} for m in MODULES}
MAX_LINES = 600


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up(module):
    mine = floor_of(module)
    up = sorted(f"{t} ({FLOORS[floor_of(t)][0]})" for t in GRAPH[module] if floor_of(t) > mine)
    assert not up, f"{module} ({FLOORS[mine][0]}) imports from above: {', '.join(up)}"


def test_megatron_stays_behind_its_adapter():
    offenders = sorted(m for m in MODULES if any(i == "megatron" or i.startswith("megatron.")
                                                  for i in imports(m))
                       and not any(fnmatch.fnmatchcase(m, p) for p in MEGATRON_ALLOWED))
    assert not offenders, f"import Megatron-Core outside its adapter: {offenders}"


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of `graph`: its strongly connected components with more than
    one module, each sorted, in sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_no_import_cycle():
    """No circle anywhere in the package, inside a folder or across folders, counting
    lazy imports and `if TYPE_CHECKING:` ones."""
    found = circles(NAMED)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_is_over_the_line_limit():
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    over = sorted(f"{MODULES[m].relative_to(PACKAGE.parent)} ({n} lines)"
                  for m, n in lines.items() if n > MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines (split them by what they do): {', '.join(over)}"


def test_the_circle_check_finds_every_circle():
    """The checker itself: two circles, one through three modules, and no false ones."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_rules_catch_an_upward_import():
    """The checker itself: a balancing module importing the controller is refused."""
    assert floor_of("dynmo_plugin.balancing.solve") < floor_of("dynmo_plugin.controller")
    assert floor_of("dynmo_plugin.scenarios.moe.config") < floor_of("dynmo_plugin.megatron.x")
    assert floor_of("dynmo_plugin.scenarios.moe.live") > floor_of("dynmo_plugin.megatron.x")
