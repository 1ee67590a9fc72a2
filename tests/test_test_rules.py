"""The tests' own rules: no test passes by skipping its checks when a condition is false.

A test that swallows the error it was about (`except InfeasibleError: return`) or asserts
only `if events:` passes when the product stops producing what it checks. Where the
condition can legitimately be false (a random instance with no feasible layout), the
test asserts the condition itself, against its own oracle. Read from the source (ast):
- an `except` in a test whose body is only `return`, `pass` or `continue` (polling
  loops, which retry and fail after the loop, are the exception);
- an `if X:` with no `else` whose body is only asserts, X a bare value (its truth) that
  no earlier assert of the test checked.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _test_functions():
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                yield path.relative_to(TESTS), node


def _in_loop(fn: ast.FunctionDef, target: ast.AST) -> bool:
    return any(target in ast.walk(loop) for loop in ast.walk(fn) if isinstance(loop, (ast.For, ast.While)))


def _swallowing_handlers(fn: ast.FunctionDef):
    for node in ast.walk(fn):
        if (isinstance(node, ast.ExceptHandler) and len(node.body) == 1
                and isinstance(node.body[0], (ast.Return, ast.Pass, ast.Continue))
                and not _in_loop(fn, node)):
            yield node.lineno


def _asserted_before(fn: ast.FunctionDef, test: ast.expr, line: int) -> bool:
    """The guard's own value was asserted earlier (e.g. `assert outcome == ("user" if bad
    else "ok")` before `if bad:`): then the branch refines a checked fact."""
    text = ast.unparse(test)
    return any(isinstance(n, ast.Assert) and n.lineno < line and
               any(ast.unparse(m) == text for m in ast.walk(n.test)) for n in ast.walk(fn))


def _truthy_guards(fn: ast.FunctionDef):
    for node in ast.walk(fn):
        if (isinstance(node, ast.If) and not node.orelse
                and isinstance(node.test, (ast.Name, ast.Attribute, ast.Subscript, ast.Call))
                and all(isinstance(b, ast.Assert) for b in node.body)
                and not _asserted_before(fn, node.test, node.lineno)):
            yield node.lineno


def test_no_test_swallows_the_error_it_is_about():
    offenders = [f"{path}:{line} {fn.name}" for path, fn in _test_functions()
                 for line in _swallowing_handlers(fn)]
    assert not offenders, "except -> return/pass in a test (assert why it may fail): " + ", ".join(offenders)


def test_no_test_asserts_only_when_something_happened():
    offenders = [f"{path}:{line} {fn.name}" for path, fn in _test_functions()
                 for line in _truthy_guards(fn)]
    assert not offenders, "`if X: assert` with no else (assert X itself): " + ", ".join(offenders)


def test_the_rules_catch_their_examples(tmp_path):
    """Both rules fire on the patterns they name and not on a polling loop."""
    src = ("def test_a():\n    try:\n        f()\n    except ValueError:\n        return\n"
           "def test_b(events):\n    if events:\n        assert events[0]\n"
           "def test_d(bad, out):\n    assert out == bad\n    if bad:\n        assert out\n"
           "def test_c():\n    for _ in range(3):\n        try:\n            f()\n"
           "        except OSError:\n            return\n    raise AssertionError\n")
    fns = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}
    assert list(_swallowing_handlers(fns["test_a"])) == [4]
    assert list(_truthy_guards(fns["test_b"])) == [7]
    assert list(_swallowing_handlers(fns["test_c"])) == []
    assert list(_truthy_guards(fns["test_d"])) == []
