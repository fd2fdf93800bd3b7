"""Sphinx directives ``grpo-config-table`` and ``grpo-settings-table``: the config reference,
generated from the config tree.

Usage (Markdown page, MyST)::

    ```{grpo-config-table} RecipeConfig
    ```

    ```{grpo-settings-table} AdvantageSettings
    ```

``grpo-config-table`` names a config tree of :mod:`torchtune_grpo.config.schema`
(``RecipeConfig``, ``AsyncConfig`` or ``EvalConfig``) and lists its fields: key, type (in the
config's words, from the annotation), default and meaning (the field's ``doc``).
``grpo-settings-table`` names the settings dataclass of a nested block of ``RecipeConfig`` and
lists its fields with the meanings of its ``Attributes:`` docstring. Both are built at every
docs build, so the reference cannot drift from what
:func:`torchtune_grpo.config.validation.validate_config` enforces.
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

#: The config trees a ``grpo-config-table`` may name.
TREES = ("RecipeConfig", "AsyncConfig", "EvalConfig")


def format_default(value: Any) -> str:
    """The default as reStructuredText: ``required``, ``null`` or a literal YAML-ish value."""
    from torchtune_grpo.config.schema import REQUIRED

    if value is REQUIRED:
        return "**required**"
    if value is None:
        return "``null``"
    if isinstance(value, bool):
        return "``true``" if value else "``false``"
    return f"``{value!r}``"


def table_rows(tree_name: str) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` of every field of the config tree ``tree_name``, in
    field order.

    Raises:
        ValueError: ``tree_name`` is not one of :data:`TREES`.
    """
    import torchtune_grpo.config.schema as schema
    from torchtune_grpo.config.settings import keys_of

    if tree_name not in TREES:
        raise ValueError(f"grpo-config-table: unknown config tree {tree_name!r}; use one of "
                         f"{TREES}")
    return [
        (f"``{name}``", f"``{spec.type}``", format_default(spec.default),
         " ".join(spec.doc.split()))
        for name, spec in keys_of(getattr(schema, tree_name)).items()
    ]


def nested_blocks() -> dict[str, str]:
    """Settings dataclass name -> the key of ``RecipeConfig`` whose type it is (the nested
    blocks: ``AdvantageSettings`` -> ``advantages``, ...)."""
    from torchtune_grpo.config.schema import RecipeConfig
    from torchtune_grpo.config.settings import keys_of

    return {spec.settings.__name__: name for name, spec in keys_of(RecipeConfig).items()
            if spec.settings is not None}


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> text`` from the ``Attributes:`` section of a Google-style class docstring."""
    docs: dict[str, str] = {}
    current = None
    in_section = False
    for line in (cls.__doc__ or "").splitlines():
        stripped = line.strip()
        if stripped == "Attributes:":
            in_section = True
            continue
        if not in_section or not stripped:
            continue
        match = re.match(r"^(\w+):\s*(.*)$", stripped)
        if match and line.startswith(" " * 8) and not line.startswith(" " * 12):
            current = match.group(1)
            docs[current] = match.group(2)
        elif current is not None:
            docs[current] += " " + stripped
    return docs


def settings_rows(settings_name: str) -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` of every key of a nested block, in field order; fields the
    recipe sets itself (``set_by_recipe`` metadata) are left out.

    Raises:
        ValueError: ``settings_name`` is not the type of a nested block of ``RecipeConfig``.
    """
    import dataclasses

    from torchtune_grpo.config.schema import RECIPE_KEYS

    blocks = nested_blocks()
    if settings_name not in blocks:
        raise ValueError(f"grpo-settings-table: unknown settings {settings_name!r}; use one "
                         f"of {tuple(blocks)}")
    block = blocks[settings_name]
    cls = RECIPE_KEYS[block].settings
    docs = _attribute_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("set_by_recipe"):
            continue
        text = " ".join(docs.get(f.name, "").split())
        text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)  # Sphinx roles as literals
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((f"``{block}.{f.name}``", format_default(default), text))
    return rows


def _inline(text: str) -> list[nodes.Node]:
    """Nodes for a cell: ````literal```` and ``**strong**`` become markup, the rest text."""
    out: list[nodes.Node] = []
    for part in re.split(r"(``[^`]+``|\*\*[^*]+\*\*)", text):
        if part.startswith("``") and part.endswith("``") and len(part) > 4:
            out.append(nodes.literal(part[2:-2], part[2:-2]))
        elif part.startswith("**") and part.endswith("**") and len(part) > 4:
            out.append(nodes.strong(part[2:-2], part[2:-2]))
        elif part:
            out.append(nodes.Text(part))
    return out


def table_node(tree_name: str) -> nodes.table:
    """A docutils table of :func:`table_rows` (header: key, type, default, meaning)."""
    return _table(("key", "type", "default", "meaning"), table_rows(tree_name),
                  (22, 14, 12, 52))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]],
           widths: tuple[int, ...]) -> nodes.table:
    table = nodes.table(classes=["grpo-config-table"])
    group = nodes.tgroup(cols=len(widths))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)

    def row(cells: tuple[str, ...]) -> nodes.row:
        r = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", *_inline(cell))
            r += entry
        return r

    head = nodes.thead()
    head += row(header)
    body = nodes.tbody()
    for cells in rows:
        body += row(cells)
    group += head
    group += body
    return table


class ConfigTable(SphinxDirective):
    """``grpo-config-table TREE``: a table of the keys of one config tree."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        try:
            return [table_node(self.arguments[0])]
        except ValueError as e:
            raise self.error(str(e)) from e


class SettingsTable(SphinxDirective):
    """``grpo-settings-table NAME``: the keys of a nested block (a settings dataclass)."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        try:
            rows = settings_rows(self.arguments[0])
        except ValueError as e:
            raise self.error(str(e)) from e
        return [_table(("key", "default", "meaning"), rows, (26, 14, 60))]


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("grpo-config-table", ConfigTable)
    app.add_directive("grpo-settings-table", SettingsTable)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
