"""Tools a policy may call inside a rollout: the tool interface, the shipped calculator, the
call syntaxes and the tools built from a config.

* :mod:`~torchtune_grpo.rollout.tools.base`: the :class:`~torchtune_grpo.rollout.tools.base.Tool`
  protocol and :func:`~torchtune_grpo.rollout.tools.base.run_tool` (failures are text);
* :mod:`~torchtune_grpo.rollout.tools.calculator`: the safe
  :class:`~torchtune_grpo.rollout.tools.calculator.Calculator`;
* :mod:`~torchtune_grpo.rollout.tools.syntax`: the tag format, ``<calculator>12*7</calculator>``
  answered by ``<result>84</result>``;
* :mod:`~torchtune_grpo.rollout.tools.chat_template`: the chat template's own format (JSON calls
  in ``<tool_call>...</tool_call>``, results rendered as tool messages) and the tools' JSON
  schemas;
* :mod:`~torchtune_grpo.rollout.tools.dispatch`: from a completion's text to the tool's answer
  (the ids that may end a call, running the call, the text appended after it);
* :mod:`~torchtune_grpo.rollout.tools.build`: the config's ``tools:`` list and ``tool_syntax``.

The rollout loop that runs them between turns is
:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`.
"""
