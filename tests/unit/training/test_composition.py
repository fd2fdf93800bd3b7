"""The recipe composes parts: no class of the library inherits from the recipe or from a class
named ``Recipe...`` (a mixin of one); behaviour is passed in as parts, never overridden."""

import ast
from pathlib import Path

import torchtune_grpo

PACKAGE = Path(torchtune_grpo.__file__).parent


def recipe_subclasses(root: Path) -> list[str]:
    """``file:line class`` for every class under ``root`` with a base named ``GRPORecipe`` or
    starting with ``Recipe`` (plain or dotted)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = (base.attr if isinstance(base, ast.Attribute)
                        else base.id if isinstance(base, ast.Name) else "")
                if name == "GRPORecipe" or name.startswith("Recipe"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}({name})")
    return found


def test_no_library_class_inherits_from_a_recipe_or_a_mixin_of_one():
    assert recipe_subclasses(PACKAGE) == []


def test_the_check_finds_a_subclass(tmp_path):
    (tmp_path / "a.py").write_text("import x\n\nclass Async(x.GRPORecipe):\n    pass\n")
    (tmp_path / "b.py").write_text("class Recipe:\n    pass\n\nclass R(RecipeUpdate, object):\n"
                                   "    pass\n")
    assert recipe_subclasses(tmp_path) == ["a.py:3 Async(GRPORecipe)",
                                           "b.py:4 R(RecipeUpdate)"]


def test_the_recipe_has_no_base_but_object():
    from torchtune_grpo.training.recipe import GRPORecipe

    assert GRPORecipe.__bases__ == (object,)
