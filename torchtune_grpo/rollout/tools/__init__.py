"""Tools a policy may call inside a rollout: the :class:`~torchtune_grpo.rollout.tools.base.Tool`
interface, the shipped calculator, the tag and chat-template call syntaxes, dispatching a
call, and building tools from a config.
"""
