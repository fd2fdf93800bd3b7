"""Checks of a config's ``_component_`` nodes against the callables they name (nothing is
built): the path imports, keys are arguments (closest suggested), required arguments are
given, values fit the annotations.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from omegaconf import DictConfig, ListConfig

from torchtune_grpo.config.schema import MAX_SEQ_LEN

#: Component paths of earlier releases and where they live now: a config copied from an earlier
#: release stops with one line naming the new path instead of an import error.
MOVED_COMPONENTS = {
    "torchtune_grpo.training.checkpointing.hf_checkpointer":
        "torchtune_grpo.models.hf_checkpointer",
}


def import_component(path: str, where: str) -> Any:
    """Import the object at dotted ``path``; errors name the config key ``where``.

    Args:
        path: a dotted import path (``module.attr``, or ``module.Class.attr``).
        where: the config key holding the path, for error messages.

    Returns:
        The imported object.

    Raises:
        ValueError: ``path`` is not dotted, names a moved component (:data:`MOVED_COMPONENTS`),
            or its module or attribute cannot be imported.
    """
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"{where}._component_ must be a dotted import path, got {path!r}")
    if path in MOVED_COMPONENTS:
        raise ValueError(f"{where}._component_: {path!r} is now {MOVED_COMPONENTS[path]!r}; "
                         "change it in the config")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        # the path may name a nested attribute (module.Class.method)
        if "." in module_name:
            try:
                return getattr(import_component(module_name, where), attr)
            except (ValueError, AttributeError):
                pass
        raise ValueError(f"{where}._component_: cannot import {path!r} ({e})") from e
    if not hasattr(module, attr):
        raise ValueError(f"{where}._component_: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _consumed_keys(node: Any, where: str, errors: list[str]) -> frozenset[str]:
    """Keys of a component node that are not arguments: ``_component_``, and on a ``rewards``
    entry the reward-set keys, whose values are checked here (problems appended to ``errors``;
    values holding ``${...}`` skipped).
    """
    head, _, index = where.partition("[")
    if head != "rewards" or not index.endswith("]") or not index[:-1].isdigit():
        return frozenset({"_component_"})
    from torchtune_grpo.rewards.reward_set import REWARD_ENTRY_KEYS, check_reward_entry

    resolved = {k: v for k, v in node.items() if not (isinstance(v, str) and "${" in v)}
    try:
        check_reward_entry(resolved, f"{where} ({node['_component_']})")
    except ValueError as e:
        errors.append(str(e))
    return REWARD_ENTRY_KEYS


#: Arguments the recipes pass to a top-level block's component themselves (so the config does
#: not give them): the datasets get the tokenizer, the scheduler the optimizer and the number
#: of steps; the optimizer's first (positional) argument, the parameters, is left out too.
_SUPPLIED_ARGUMENTS = {"dataset": {"tokenizer"}, "eval_dataset": {"tokenizer"},
                       "lr_scheduler": {"optimizer", "num_training_steps"}}


def _component_params(obj: Any) -> tuple[set[str], bool, list[str]] | None:
    """Parameter names of a component, whether it takes ``**kwargs``, and its parameters
    without a default in order (None: unknown)."""
    import inspect

    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = {p.name for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    required = [p.name for p in sig.parameters.values() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, takes_kwargs, required


#: Component arguments that count something (layers, heads, tokens): an integer below 1 is
#: an error whatever the component.
_COUNT_ARGUMENTS = frozenset({"vocab_size", "num_layers", "num_heads", "num_kv_heads",
                              "embed_dim", "intermediate_dim", "head_dim", "max_seq_len"})


def _argument_errors(where: str, node: Any, obj: Any) -> list[str]:
    """Component arguments whose value cannot fit the component's annotation (a list for a
    ``str``, a string for an ``int``), and counts below 1."""
    import inspect
    import typing

    from torchtune_grpo.config.settings import hint_name, value_fits

    errors = []
    for key, value in node.items():
        if (key in _COUNT_ARGUMENTS and isinstance(value, int) and not isinstance(value, bool)
                and value < 1):
            errors.append(f"config key {where}.{key} must be >= 1 (got {value!r})")
        if key == "max_seq_len" and isinstance(value, int) and value > MAX_SEQ_LEN:
            errors.append(f"config key {where}.{key} must be <= {MAX_SEQ_LEN} (got {value!r})")
    try:
        target = obj.__init__ if inspect.isclass(obj) else obj
        hints = typing.get_type_hints(target)
        defaults = {p.name: p.default for p in inspect.signature(obj).parameters.values()}
    except Exception:  # noqa: BLE001 (annotations that do not resolve are not checked)
        return errors
    for key, value in node.items():
        if key not in hints or key == "_component_" or key not in defaults:
            continue
        if value is None and defaults[key] is None:
            continue  # ``x: int = None`` without Optional
        if not value_fits(hints[key], value):
            errors.append(f"config key {where}.{key}: {node['_component_']} takes "
                          f"{hint_name(hints[key])}, got {value!r}")
    return errors


def _missing_arguments(where: str, node: Any, required: list[str], obj: Any) -> list[str]:
    """Required arguments of the component at ``where`` that neither the config nor the
    recipe gives."""
    import inspect

    if where.startswith(("rewards[", "tools[")) and not inspect.isclass(obj):
        return []  # a function reward or tool: its parameters are what it is called with
    supplied = set(_SUPPLIED_ARGUMENTS.get(where, ()))
    if where == "optimizer" and required:
        supplied.add(required[0])  # the parameters, passed positionally
    return [name for name in required if name not in node and name not in supplied]


def check_components(node: Any, where: str, errors: list[str],
                     params_out: dict[str, set[str]] | None = None) -> None:
    """Check every ``_component_`` node in ``node`` (recursively) against its callable.

    Args:
        node: a config (or part of one) as plain containers or OmegaConf nodes.
        where: the config key of ``node`` (``""`` for the whole config); messages name keys
            from it (``optimizer.lr``, ``rewards[0].weight``).
        errors: problems found are appended here, each naming its key.
        params_out: when given, filled with ``where -> argument names`` for each component
            whose signature could be read.
    """
    if isinstance(node, (dict, DictConfig)):
        if "_component_" in node:
            try:
                obj = import_component(node["_component_"], where)
            except ValueError as e:
                errors.append(str(e))
                obj = None
            consumed = _consumed_keys(node, where, errors)
            info = _component_params(obj) if obj is not None else None
            if info is not None:
                names, takes_kwargs, required = info
                if params_out is not None:
                    params_out[where] = names
                errors.extend(_argument_errors(where, node, obj))
                errors.extend(
                    f"config key {where}.{name}: {node['_component_']} needs argument "
                    f"{name!r}, and the config does not give it"
                    for name in _missing_arguments(where, node, required, obj))
                if not takes_kwargs:
                    for key in node:
                        if key in consumed or key in names:
                            continue
                        close = difflib.get_close_matches(str(key), sorted(names), n=1)
                        hint = f" Did you mean {where}.{close[0]}?" if close else ""
                        errors.append(
                            f"config key {where}.{key}: {node['_component_']} takes no "
                            f"argument {key!r}.{hint}"
                        )
        for key, value in node.items():
            check_components(value, f"{where}.{key}" if where else str(key), errors, params_out)
    elif isinstance(node, (list, ListConfig)):
        for i, value in enumerate(node):
            check_components(value, f"{where}[{i}]", errors, params_out)
