"""From a completion's text to the tool's answer: the ids that may end a call, and running it.

The rollout loop (:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`) stops a turn on
every token that may complete a call's close tag (:func:`close_tag_token_ids`); when the decoded
text then holds a new close tag, the call is answered (:func:`answer_call`): the tool runs (it
never raises) and the text appended after the call is its result in the syntax's tags, or, in
the chat-template format, what the tokenizer's chat template renders after the call.
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
    """``[c]`` long: the allowed ids whose text holds the last character of a close tag.

    A close tag can only be completed by such a token, so a turn that stops on them (and then
    checks the text) misses no call. In the chat-template format the set is narrower: the ids
    whose text can end the close tag
    (:meth:`~torchtune_grpo.rollout.tools.chat_template.ChatTemplateToolSyntax.may_complete`),
    so the open tag's ``>`` is no false alarm.

    Args:
        syntax: the call syntax.
        names: the tools' names.
        tokenizer: the run's tokenizer (``decode(ids)``).
        vocab_size: ``V``.
        allowed: ``[V]`` bool, the ids sampling may emit (None: every id the tokenizer
            decodes).

    Returns:
        The ids, ascending.
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
        tokenizer: the run's tokenizer (chat-template format: its ``apply_chat_template`` and
            ``special_tokens``).
        text: the decoded completion so far (model and tool tokens), ending with a close tag.
        tool_schemas: the tools' JSON schemas (chat-template format: given to the template).

    Returns:
        ``(result, appended text)``: the tool's result (``error: ...`` for a call that cannot
        run) and the text to append after the call: the result in the syntax's result tags,
        or (chat-template format) the end of the assistant turn, the tool message and the new
        assistant header as the chat template renders them.
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
