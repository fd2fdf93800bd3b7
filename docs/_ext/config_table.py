"""Sphinx directive ``grpo-config-table``: the config reference, generated from the code.

Usage (Markdown page, MyST)::

    ```{grpo-config-table} RECIPE_KEYS
    ```

The argument names a ``dict[str, Key]`` of :mod:`torchtune_grpo.config` (``RECIPE_KEYS`` or
``EVAL_KEYS``). The table is built from that dict at every docs build, so the reference cannot
drift from the schema that :func:`torchtune_grpo.config.validate_config` enforces.
"""

from __future__ import annotations

import re
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

SCHEMAS = ("RECIPE_KEYS", "EVAL_KEYS")


def format_default(value: Any) -> str:
    """The default as reStructuredText: ``required``, ``null`` or a literal YAML-ish value."""
    from torchtune_grpo.config import REQUIRED

    if value is REQUIRED:
        return "**required**"
    if value is None:
        return "``null``"
    if isinstance(value, bool):
        return "``true``" if value else "``false``"
    return f"``{value!r}``"


def table_rows(schema_name: str) -> list[tuple[str, str, str, str]]:
    """``(key, type, default, meaning)`` of every key of ``schema_name``, in schema order."""
    import torchtune_grpo.config as cfg

    if schema_name not in SCHEMAS:
        raise ValueError(f"grpo-config-table: unknown schema {schema_name!r}; use one of {SCHEMAS}")
    schema = getattr(cfg, schema_name)
    return [
        (f"``{key}``", f"``{spec.type}``", format_default(spec.default), " ".join(spec.doc.split()))
        for key, spec in schema.items()
    ]


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


def table_node(schema_name: str) -> nodes.table:
    """A docutils table of :func:`table_rows` (header: key, type, default, meaning)."""
    widths = (22, 14, 12, 52)
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
    head += row(("key", "type", "default", "meaning"))
    body = nodes.tbody()
    for cells in table_rows(schema_name):
        body += row(cells)
    group += head
    group += body
    return table


class ConfigTable(SphinxDirective):
    """``grpo-config-table SCHEMA``: a table of one config schema."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        try:
            return [table_node(self.arguments[0])]
        except ValueError as e:
            raise self.error(str(e)) from e


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("grpo-config-table", ConfigTable)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
