"""The limits that keep the package's layout readable (docs/design.md, "The layout"): no library
module over 500 lines, no import cycle among the package's modules (lazy imports inside
functions included), no test that loads a benchmark by file path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import torchtune_grpo

PACKAGE = Path(torchtune_grpo.__file__).parent
REPO = PACKAGE.parent
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    """``module name -> file`` of every module of the package (configs are data)."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if "configs" not in p.relative_to(PACKAGE).parts}


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``;
    importing a package also runs its ``__init__``, so ``a.b`` counts as well.
    """
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a list of modules, first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_library_module_is_over_500_lines():
    long = {name: n for name, path in library_modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by responsibility (limit {MAX_LINES} lines): {long}"


def test_no_import_cycle_among_the_package_modules():
    modules = library_modules()
    graph = {name: imported_modules(path, name, set(modules)) - _parents(name)
             for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def _parents(name: str) -> set[str]:
    """A module's enclosing packages: importing them is implied, not a cycle."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_inside_functions_count(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from pkg.sub import thing\n")
    assert imported_modules(mod, "pkg.m", {"pkg", "pkg.sub", "pkg.m"}) == {"pkg.sub"}


@pytest.mark.parametrize("path", sorted((REPO / "tests").rglob("*.py")), ids=lambda p: p.name)
def test_no_test_loads_a_benchmark_by_path(path):
    if not (REPO / "benchmarks").is_dir():
        pytest.skip("no benchmarks/ folder next to the package")
    text = path.read_text()
    if path.name == "test_layout.py":
        return
    assert not ("spec_from_file_location" in text and "benchmarks" in text), (
        f"{path}: import the benchmark as a module (from benchmarks import NAME)")
    assert not re.search(r"benchmarks/[\w/]+\.py", text), (
        f"{path}: refers to a benchmark by file path; use `python -m benchmarks.NAME` or import it")
