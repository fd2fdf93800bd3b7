"""From a completion's text to the tool's answer: :func:`close_tag_token_ids` (the ids that may
end a call) and :func:`answer_call` (running the call and the text appended after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchtune_grpo.rollout.tools.base import ERROR_PREFIX, Tool, run_tool
from torchtune_grpo.rollout.tools.chat_template import ChatTemplateToolSyntax, call_tool_json
from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax

__all__ = ["answer_call", "close_tag_token_ids"]


def close_tag_token_ids(syntax: ToolCallSyntax | ChatTemplateToolSyntax, names: Sequence[str],
                        tokenizer: Any, vocab_size: int,
                        allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``[c]`` long, ascending: the allowed ids whose text holds the last character of a close tag
    (chat-template format: those that may complete it, ``may_complete``).

    Args:
        syntax: the call syntax.
        names: the tools' names.
        tokenizer: the run's tokenizer (``decode(ids)``).
        vocab_size: ``V``.
        allowed: ``[V]`` bool, the ids sampling may emit (None: every id the tokenizer
            decodes).
    """
    finals = syntax.final_characters(list(names))
    if any(not c.isascii() for c in finals):
        finals = finals | {"\ufffd"}  # a byte of a multi-byte character decodes as U+FFFD
    # chat-template format: only ids whose text can end the close tag (not "<tool_call>")
    may_complete = getattr(syntax, "may_complete", None)
    ids = []
    for i in range(vocab_size):
        if allowed is not None and not bool(allowed[i]):
            continue
        try:
            text = tokenizer.decode([i])
        except Exception:  # noqa: BLE001 - an undecodable id cannot finish a tag
            continue
        if may_complete(text) if may_complete is not None else any(c in text for c in finals):
            ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


def answer_call(syntax: ToolCallSyntax | ChatTemplateToolSyntax, tools: Mapping[str, Tool],
                tokenizer: Any, text: str,
                tool_schemas: list[dict[str, Any]] | None = None) -> tuple[str, str]:
    """Run the call that ``text`` ends with; never raises for anything the model wrote.

    Args:
        syntax: the call syntax.
        tools: the tools by name.
        tokenizer: the run's tokenizer (chat-template format: ``apply_chat_template`` and
            ``special_tokens``).
        text: the decoded completion so far, ending with a close tag.
        tool_schemas: the tools' JSON schemas (chat-template format).

    Returns:
        ``(result, appended text)``: the tool's result (``error: ...`` for a call that cannot
        run) and the text appended after the call (the result tags, or in the chat-template
        format the template's rendering of the tool message).
    """
    if isinstance(syntax, ChatTemplateToolSyntax):
        return _answer_chat_call(syntax, tools, tokenizer, text, tool_schemas)
    result = _answer_tag_call(syntax, tools, text)
    return result, syntax.format_result(result)


def _answer_chat_call(syntax: ChatTemplateToolSyntax, tools: Mapping[str, Tool], tokenizer: Any,
                      text: str, tool_schemas: list[dict[str, Any]] | None) -> tuple[str, str]:
    """``(result, appended text)`` of the chat-template-format call ``text`` ends with."""
    call = syntax.last_call(text, list(tools))
    if call is None:  # not reached: the caller saw a new close tag
        return f"{ERROR_PREFIX} no tool call found", ""
    if call.error is not None:
        result = call.error
    else:
        result = call_tool_json(tools[call.name], call.arguments)
    # the tool's text must not add special tokens (an end of turn, a header) of its own
    content = result
    for token in getattr(tokenizer, "special_tokens", None) or {}:
        content = content.replace(token, "")
    return result, syntax.result_text(tokenizer, call.name, call.arguments, content,
                                      tool_schemas)


def _answer_tag_call(syntax: ToolCallSyntax, tools: Mapping[str, Tool], text: str) -> str:
    """The result text of the tag-format call that ``text`` ends with."""
    call = syntax.last_call(text, list(tools))
    if call is None:  # not reached: the caller saw a new close tag
        return f"{ERROR_PREFIX} no tool call found"
    if call.arguments is None:
        return (f"{ERROR_PREFIX} {syntax.close_tag(call.name)} without "
                f"{syntax.open_tag(call.name)}")
    return run_tool(tools[call.name], call.arguments)
