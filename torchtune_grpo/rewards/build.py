"""Building a :class:`~torchtune_grpo.rewards.reward_set.RewardSet` from a config's ``rewards``
list: the checks that involve several entries, default names and the success entry.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.rewards.reward_set import (
    DEFAULT_SUCCESS_THRESHOLD,
    RewardEntry,
    RewardFn,
    RewardSet,
    check_reward_entry,
)

__all__ = ["build_reward_set"]


def _snake_case(name: str) -> str:
    """``NumericCorrectness`` -> ``numeric_correctness``; ``HTTPReward`` -> ``http_reward``."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return name.lower()


def _is_reward_function(obj: Any) -> bool:
    """A plain function whose first two parameters are ``completions`` and ``answers``."""
    if not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        return False
    try:
        params = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return False
    return params[:2] == ["completions", "answers"]


def _default_name(component: Any, path: str) -> str:
    """The component's ``name`` attribute, else its snake_case class (or function) name."""
    name = getattr(component, "name", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(component, functools.partial):
        component = component.func
    if inspect.isfunction(component):
        return component.__name__
    cls_name = type(component).__name__ if not inspect.isclass(component) else component.__name__
    return _snake_case(cls_name) or path.rsplit(".", 1)[-1]


def _build_component(path: str, arguments: dict[str, Any], index: int, where: str) -> RewardFn:
    """Import ``path`` and build the component callable with ``arguments``."""
    from torchtune import config as tt_config
    from torchtune.config._utils import _get_component_from_path

    try:
        target = _get_component_from_path(path)
    except Exception as exc:
        raise ValueError(
            f"rewards[{index}]: `_component_` {path!r} does not import: {exc}. Check the "
            "dotted path and that its module is installed or on PYTHONPATH."
        ) from exc
    try:
        if _is_reward_function(target):
            component = functools.partial(target, **arguments) if arguments else target
        else:
            component = tt_config.instantiate(OmegaConf.create({"_component_": path, **arguments}))
    except Exception as exc:
        raise ValueError(
            f"{where}: could not construct the component with arguments {arguments}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not callable(component):
        raise ValueError(
            f"{where}: built a {type(component).__name__}, which is not callable; a reward "
            "component must be called as component(completions, answers, **kwargs)"
        )
    return component


def _success_index(success_flags: list[bool | None], thresholds_set: list[bool]) -> int:
    """Index of the entry that defines success (see :func:`build_reward_set`)."""
    marked = [i for i, flag in enumerate(success_flags) if flag is True]
    if len(marked) > 1:
        raise ValueError(
            f"rewards[{marked[1]}]: `success: true` is also set on rewards[{marked[0]}]; at "
            "most one entry may define success"
        )
    if marked:
        success_index = marked[0]
    else:
        candidates = [i for i, flag in enumerate(success_flags) if flag is not False]
        if not candidates:
            raise ValueError(
                "rewards: every entry sets `success: false`; set `success: true` on the entry "
                "that defines success_rate"
            )
        success_index = candidates[0]
    for i, has_threshold in enumerate(thresholds_set):
        if has_threshold and i != success_index:
            raise ValueError(
                f"rewards[{i}]: `success_threshold` is set but this entry does not define "
                f"success (rewards[{success_index}] does); move it or set `success: true` here"
            )
    return success_index


def build_reward_set(cfg_list: ListConfig | Sequence[Mapping[str, Any]]) -> RewardSet:
    """The :class:`~torchtune_grpo.rewards.reward_set.RewardSet` of a config's ``rewards`` list.

    Each entry has ``_component_`` (a reward class or factory, instantiated with the entry's other
    keys, or a function whose first two parameters are ``completions, answers``) and the set's keys
    (:data:`~torchtune_grpo.rewards.reward_set.REWARD_ENTRY_KEYS`). ``name`` defaults to the
    component's ``name`` attribute, else its snake_case class or function name; without
    ``success: true`` the first entry not marked ``success: false`` defines success;
    ``success_threshold`` defaults to ``1 - 1e-6``.

    Args:
        cfg_list: an OmegaConf ``ListConfig`` or a list of dicts.

    Returns:
        The :class:`~torchtune_grpo.rewards.reward_set.RewardSet`.

    Raises:
        ValueError: naming the entry (``rewards[i]``) and key, on an empty list, an entry that
            is not a mapping or lacks ``_component_``, a ``_component_`` that does not import,
            a component that cannot be constructed or is not callable, a bad ``weight``,
            ``success``, ``success_threshold`` or ``on_error``, several ``success: true``
            entries, or duplicate names.
    """
    if cfg_list is None or isinstance(cfg_list, str | bytes | Mapping | DictConfig):
        raise ValueError(
            "rewards: expected a list of entries, each with a `_component_` key, got "
            f"{type(cfg_list).__name__}"
        )
    items = list(cfg_list)
    if not items:
        raise ValueError(
            "rewards: the list is empty; add at least one entry such as "
            "`- _component_: torchtune_grpo.rewards.components.NumericCorrectness`"
        )
    # torchtune.config.instantiate does the same, so that modules next to the config import.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())

    entries: list[RewardEntry] = []
    success_flags: list[bool | None] = []
    thresholds_set: list[bool] = []
    for i, item in enumerate(items):
        if isinstance(item, DictConfig):
            node = OmegaConf.to_container(item, resolve=True)
        elif isinstance(item, Mapping):
            node = dict(item)
        else:
            raise ValueError(f"rewards[{i}]: expected a mapping with `_component_`, got {item!r}")
        path = node.get("_component_")
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"rewards[{i}]: missing `_component_`; set it to the dotted path of a reward "
                "component, e.g. torchtune_grpo.rewards.components.NumericCorrectness"
            )
        where = f"rewards[{i}] ({path})"
        options, arguments = check_reward_entry(node, where)
        component = _build_component(path, arguments, i, where)
        threshold = options["success_threshold"]
        entries.append(
            RewardEntry(
                name=options["name"] or _default_name(component, path),
                fn=component,
                weight=options["weight"],
                success_threshold=DEFAULT_SUCCESS_THRESHOLD if threshold is None else threshold,
                on_error=options["on_error"],
                requires_success=options["requires_success"],
            )
        )
        success_flags.append(options["success"])
        thresholds_set.append(threshold is not None)
    success_index = _success_index(success_flags, thresholds_set)
    return RewardSet(entries, success_name=entries[success_index].name)
