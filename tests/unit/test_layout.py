"""The limits that keep the package's layout readable (docs/design.md, "The layout"): no library
module over 500 lines, no folder of more than 10 modules, no import cycle among the package's
modules, no import from a sub-package later in :data:`LAYERS` (lazy imports inside functions
included), no test that loads a benchmark by file path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import torchtune_grpo

PACKAGE = Path(torchtune_grpo.__file__).parent
REPO = PACKAGE.parent
MAX_LINES = 500
MAX_MODULES_PER_FOLDER = 10

#: The sub-packages in layer order: a module imports from its own sub-package and from those
#: listed before it, never from one listed after it. ``""`` is the top-level modules
#: (``errors``, ``distributed``, ``token_rules``). The policy's building blocks (decoder, head,
#: forward passes, KV cache) come first because every model is built as a policy decoder;
#: the pure algorithm precedes the parts that produce its inputs; the run's parts
#: (evaluation, checkpoints, the config tree, the training loop) come after everything they
#: compose; the command line is last.
LAYERS = ["", "policy", "models", "backends", "algorithm", "rollout", "rewards", "datasets",
          "evaluation", "checkpoints", "config", "training", "quickstart", "cli"]


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


def layer_of(name: str) -> str:
    """The :data:`LAYERS` entry of module ``name`` (``""`` for a top-level module)."""
    parts = name.split(".")
    is_package = (PACKAGE.parent / Path(*parts) / "__init__.py").is_file()
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else ""


def upward_imports(modules: dict[str, Path]) -> list[str]:
    """``"a -> b"`` for every import of a module from a sub-package later in :data:`LAYERS`."""
    found = []
    for name, path in modules.items():
        here = LAYERS.index(layer_of(name))
        for target in sorted(imported_modules(path, name, set(modules))):
            if LAYERS.index(layer_of(target)) > here:
                found.append(f"{name} -> {target}")
    return found


def test_every_sub_package_has_a_layer():
    missing = {layer_of(name) for name in library_modules()} - set(LAYERS)
    assert not missing, f"add these sub-packages to LAYERS (in import order): {sorted(missing)}"


def test_no_module_imports_from_a_later_layer():
    upward = upward_imports(library_modules())
    assert not upward, (
        "imports back up the layers (move the shared code down, or pass it in):\n  "
        + "\n  ".join(upward))


def test_the_layer_check_sees_a_lazy_upward_import(tmp_path, monkeypatch):
    """A function-level import of a later layer is caught (the check is not vacuous)."""
    modules = library_modules()
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from torchtune_grpo.training.recipe import GRPORecipe\n")
    modules["torchtune_grpo.policy.fake"] = fake
    assert upward_imports(modules) == [
        "torchtune_grpo.policy.fake -> torchtune_grpo.training.recipe"]


def test_no_folder_holds_more_than_ten_modules():
    counts: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if "configs" not in path.relative_to(PACKAGE).parts:
            folder = str(path.parent.relative_to(PACKAGE.parent))
            counts[folder] = counts.get(folder, 0) + 1
    big = {folder: n for folder, n in counts.items() if n > MAX_MODULES_PER_FOLDER}
    assert not big, f"split these folders by role (limit {MAX_MODULES_PER_FOLDER}): {big}"


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
