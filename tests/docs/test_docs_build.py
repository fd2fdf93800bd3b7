"""The Sphinx site builds with warnings as errors, and its config reference cannot drift.

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _require_sphinx():
    pytest.importorskip("sphinx", reason="docs extra not installed (pip install -e '.[docs]')")
    pytest.importorskip("myst_parser", reason="docs extra not installed (pip install -e '.[docs]')")


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path):
    _require_sphinx()
    out = tmp_path / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
         str(DOCS), str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"sphinx failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    from torchtune_grpo.config.schema import EVAL_KEYS, RECIPE_KEYS

    reference = (out / "config_reference.html").read_text()
    missing = [k for k in {**RECIPE_KEYS, **EVAL_KEYS} if f'<span class="pre">{k}</span>' not in
               reference]
    assert not missing, f"config keys missing from the generated reference: {missing}"
    api = (out / "api.html").read_text()
    for name in ("GRPORecipe", "GRPOLoss", "group_advantages", "save_step_checkpoint",
                 "evaluate", "read_disk_log", "gsm8k_dataset", "Trajectory"):
        assert name in api, f"{name} not documented in api.html"


def _config_table():
    """The docs' ``config_table`` extension module (docs/_ext)."""
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import config_table
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return config_table


def test_config_table_lists_every_field_of_the_tree_in_order():
    _require_sphinx()
    import dataclasses

    config_table = _config_table()
    from torchtune_grpo.config import schema

    for name in config_table.TREES:
        tree = getattr(schema, name)
        rows = config_table.table_rows(name)
        assert [r[0] for r in rows] == [f"``{f.name}``" for f in dataclasses.fields(tree)]
        assert all(r[1] and r[2] and r[3] for r in rows)
        table = config_table.table_node(name)
        assert len(list(table.findall(lambda n: n.tagname == "row"))) == len(rows) + 1
    rows = {r[0]: r for r in config_table.table_rows("RecipeConfig")}
    assert rows["``batch_size``"][1:3] == ("``int|null``", "``null``")
    assert rows["``group_size``"][1:3] == ("``int``", "**required**")
    assert rows["``run_health``"][1:3] == ("``dict|null``", "``{}``")
    with pytest.raises(ValueError, match="unknown config tree"):
        config_table.table_rows("RECIPE_KEYS")


def test_settings_tables_list_every_key_of_the_nested_blocks():
    _require_sphinx()
    import dataclasses

    config_table = _config_table()
    from torchtune_grpo.config.schema import RECIPE_KEYS

    blocks = config_table.nested_blocks()
    assert blocks == {"EvalSettings": "eval", "AdvantageSettings": "advantages",
                      "DynamicSamplingSettings": "dynamic_sampling",
                      "HealthSettings": "run_health"}
    for name, key in blocks.items():
        cls = RECIPE_KEYS[key].settings
        assert cls.__name__ == name
        rows = config_table.settings_rows(name)
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "seed"]
        assert [r[0] for r in rows] == [f"``{key}.{f}``" for f in fields]
        assert all(r[1] and r[2] for r in rows), rows
    with pytest.raises(ValueError, match="unknown settings"):
        config_table.settings_rows("Key")


def test_api_page_covers_every_public_module():
    """docs/api.rst has an automodule for every module of the package (private ones excepted)."""
    package = DOCS.parent / "torchtune_grpo"
    text = (DOCS / "api.rst").read_text()
    documented = {line.split("::", 1)[1].strip() for line in text.splitlines()
                  if line.startswith(".. automodule::")}
    expected = {"torchtune_grpo.datasets"}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = rel.parts
        if any(p.startswith("_") for p in parts) or "datasets" in parts or "configs" in parts:
            continue
        expected.add(".".join(parts))
    exempt = {"torchtune_grpo.quickstart.tiny", "torchtune_grpo.quickstart.prepare",
              "torchtune_grpo.quickstart.tools", "torchtune_grpo.quickstart.cli",
              "torchtune_grpo.cli.plot"}
    missing = sorted(expected - documented - exempt)
    assert not missing, f"add these modules to docs/api.rst: {missing}"
