"""Tools and the call syntax from a config's ``tools:`` list and ``tool_syntax``; a user's own
tool plugs in by its ``_component_`` path::

    tools:
      - _component_: torchtune_grpo.rollout.tools.calculator.Calculator
        max_digits: 30
      - _component_: my_package.tools.WordCount
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchtune_grpo.rollout.tools.base import Tool
from torchtune_grpo.rollout.tools.chat_template import CHAT_TEMPLATE_FORMAT, ChatTemplateToolSyntax
from torchtune_grpo.rollout.tools.syntax import TAGS_FORMAT, ToolCallSyntax

__all__ = ["build_tools", "make_tool_syntax"]

#: ``tool_syntax.format`` values: configurable tags (the default) or the chat template's format.
_FORMATS = (TAGS_FORMAT, CHAT_TEMPLATE_FORMAT)


def make_tool_syntax(value: Any = None) -> ToolCallSyntax | ChatTemplateToolSyntax:
    """The call syntax of a config's ``tool_syntax`` value.

    Args:
        value: None (the default tags), a syntax object, or a mapping: ``format: tags`` (or no
            ``format``) takes the fields of
            :class:`~torchtune_grpo.rollout.tools.syntax.ToolCallSyntax`, ``format: chat_template``
            those of :class:`~torchtune_grpo.rollout.tools.chat_template.ChatTemplateToolSyntax`.

    Raises:
        ValueError: an unknown format or key (naming ``tool_syntax.<key>``), or a bad value.
    """
    import dataclasses
    import difflib

    if value is None:
        return ToolCallSyntax()
    if isinstance(value, (ToolCallSyntax, ChatTemplateToolSyntax)):
        return value
    if not hasattr(value, "keys"):
        raise ValueError(f"config key 'tool_syntax' must be a mapping, got {value!r}")
    values = {str(k): value[k] for k in value.keys()}
    fmt = values.pop("format", TAGS_FORMAT)
    if fmt not in _FORMATS:
        raise ValueError(f"config key 'tool_syntax' has format {fmt!r}: 'tool_syntax.format' "
                         f"must be {TAGS_FORMAT!r} (the default) or {CHAT_TEMPLATE_FORMAT!r}")
    cls = ChatTemplateToolSyntax if fmt == CHAT_TEMPLATE_FORMAT else ToolCallSyntax
    known = [f.name for f in dataclasses.fields(cls) if f.name != "format"]
    unknown = [k for k in values if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" Did you mean 'tool_syntax.{close[0]}'?" if close else ""
        other = ToolCallSyntax if cls is ChatTemplateToolSyntax else ChatTemplateToolSyntax
        if unknown[0] in {f.name for f in dataclasses.fields(other)}:
            hint = (f" 'tool_syntax.{unknown[0]}' has no meaning with format {fmt!r}"
                    + (": the result is the chat template's tool message"
                       if cls is ChatTemplateToolSyntax else "") + ".")
        raise ValueError(f"config key 'tool_syntax' has unknown key(s) {unknown} for format "
                         f"{fmt!r} (known: {', '.join(['format', *known])}).{hint}")
    return cls(**values)


def build_tools(cfg_list: Sequence[Mapping[str, Any]] | None) -> list[Tool]:
    """Instantiate the config's ``tools:`` list with torchtune's ``config.instantiate``.

    Args:
        cfg_list: None, or a list of mappings, each with a ``_component_`` and its keyword
            arguments.

    Returns:
        The tools, in config order.

    Raises:
        ValueError: naming the entry (``tools[i]``) and the key at fault: not a list, an entry
            that is not a mapping or lacks ``_component_``, a component that cannot be built, an
            object without a string ``name`` or not callable, or a duplicate name.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from torchtune import config as tt_config

    if cfg_list is None:
        return []
    if isinstance(cfg_list, (str, bytes, Mapping, DictConfig)) or not isinstance(
            cfg_list, (Sequence, ListConfig)):
        raise ValueError(
            f"config key 'tools' must be a list of {{_component_: ...}} entries, got "
            f"{type(cfg_list).__name__}"
        )
    tools: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(cfg_list):
        where = f"config key 'tools[{i}]'"
        if not isinstance(entry, (Mapping, DictConfig)):
            raise ValueError(f"{where} must be a mapping with a '_component_' key, got "
                             f"{type(entry).__name__}: {entry!r}")
        node = entry if isinstance(entry, DictConfig) else OmegaConf.create(dict(entry))
        component = node.get("_component_")
        if not isinstance(component, str) or not component:
            raise ValueError(f"{where}._component_ is missing: give the dotted path of the "
                             "tool's class, e.g. "
                             "torchtune_grpo.rollout.tools.calculator.Calculator")
        try:
            tool = tt_config.instantiate(node)
        except Exception as exc:  # noqa: BLE001 - re-raised with the entry named
            raise ValueError(f"{where}._component_={component!r} could not be built: "
                             f"{type(exc).__name__}: {exc}") from exc
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}._component_={component!r} built an object without a "
                             "string 'name' attribute (see torchtune_grpo.rollout.tools.base.Tool)")
        if not callable(tool):
            raise ValueError(f"{where}._component_={component!r} built an object that is not "
                             "callable: a tool maps argument text to result text")
        if name in seen:
            raise ValueError(f"{where}.name={name!r} is already the name of tools[{seen[name]}]"
                             ": give each tool a distinct name")
        seen[name] = i
        tools.append(tool)
    return tools
