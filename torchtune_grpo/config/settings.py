"""Typed settings of the nested config blocks: each field's default and meaning in one place.

A nested block of the config (``advantages:``, ``eval:``) is read into a small frozen
dataclass by :func:`settings_from_config`, which rejects unknown keys with the closest known
key suggested (``advantages.scael`` -> ``advantages.scale``) and checks the values in the
dataclass's ``__post_init__``. :func:`torchtune_grpo.config.validation.validate_config` runs
the same function on the raw config before anything is built, so a typo in a nested block costs
seconds; adding a key to a block means adding one field here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    DEFAULT_EPS,
    DEFAULT_ESTIMATOR,
)

__all__ = ["AdvantageSettings", "DynamicSamplingSettings", "HealthSettings", "hint_name",
           "settings_from_config", "value_fits"]

S = TypeVar("S")


@dataclass(frozen=True)
class AdvantageSettings:
    """The ``advantages:`` block: how rewards become group-relative advantages.

    Attributes:
        estimator: ``grpo`` (the group mean as baseline, divided by ``scale``), ``rloo`` (the
            mean of the other completions of the group) or ``reinforce_pp`` (the group mean,
            then normalised over the global batch of response tokens); see
            :func:`torchtune_grpo.algorithm.advantages.group_advantages`.
        scale: ``grpo`` only: ``group`` divides by each group's std (GRPO; the default when
            unset), ``batch`` by the std of the whole global batch, ``none`` does not divide
            (Dr. GRPO). Setting it with another estimator is an error.
        eps: added to the standard deviation before dividing (``>= 0``).
    """

    estimator: str = DEFAULT_ESTIMATOR
    scale: str | None = None
    eps: float = DEFAULT_EPS

    def __post_init__(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"estimator must be one of {list(ADVANTAGE_ESTIMATORS)}, got "
                             f"{self.estimator!r}")
        if self.scale is not None and self.scale not in ADVANTAGE_SCALES:
            raise ValueError(f"scale must be one of {list(ADVANTAGE_SCALES)}, got {self.scale!r}")
        if self.scale is not None and self.estimator != "grpo":
            raise ValueError(f"scale={self.scale!r} applies to estimator grpo only; "
                             f"{self.estimator} has its own normalisation (remove scale)")
        if not float(self.eps) >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """The ``dynamic_sampling:`` block (DAPO's dynamic sampling; the block null or absent: off).

    After a step's rollout and scoring, groups whose rewards all tie (no learning signal) are
    dropped and more prompts are drawn, rolled out and scored until every rank holds
    ``batch_size`` groups with a signal, or ``max_batches`` extra batches were drawn; the step
    then completes its batch with tied groups (advantage 0; see
    :func:`torchtune_grpo.training.batching.select_groups`) and logs ``dynamic_sampling/...``.

    Attributes:
        max_batches: most extra batches drawn per step (each ``batch_size`` prompts per rank,
            rolled out and scored like the main batch); ``>= 1``.
    """

    max_batches: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.max_batches, bool) or not isinstance(self.max_batches, int) \
                or self.max_batches < 1:
            raise ValueError(f"max_batches must be an integer >= 1, got {self.max_batches!r}")


@dataclass(frozen=True)
class HealthSettings:
    """The ``run_health:`` block: when the recipe warns about a run
    (:mod:`torchtune_grpo.training.health`).

    Attributes:
        window: steps averaged for every comparison (the first ``window`` steps are the
            baseline; no condition is checked before ``window`` steps, nor the length and
            hacking conditions before ``2 * window``); ``>= 1``.
        no_signal_fraction: warn when the mean ``zero_std_group_fraction`` of the last
            ``window`` steps reaches this (``0 < x <= 1``).
        length_collapse_ratio: warn when the mean response length of the last ``window`` steps
            falls to this fraction of the first ``window`` steps' mean or below, while success
            has not risen by ``min_success_gain`` (``0 < x < 1``).
        min_success_gain: the rise of the mean ``success_rate`` (latest window minus first
            window) below which success counts as flat (``>= 0``).
        hacking_rise: warn when a non-success reward component's window mean rose by at least
            this while success is flat (``> 0``; in the component's own units, which are 0-1
            for the shipped components).
    """

    window: int = 5
    no_signal_fraction: float = 0.9
    length_collapse_ratio: float = 0.5
    min_success_gain: float = 0.05
    hacking_rise: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not 0 < float(self.no_signal_fraction) <= 1:
            raise ValueError(f"no_signal_fraction must be in (0, 1], got "
                             f"{self.no_signal_fraction!r}")
        if not 0 < float(self.length_collapse_ratio) < 1:
            raise ValueError(f"length_collapse_ratio must be in (0, 1), got "
                             f"{self.length_collapse_ratio!r}")
        if not float(self.min_success_gain) >= 0:
            raise ValueError(f"min_success_gain must be >= 0, got {self.min_success_gain!r}")
        if not float(self.hacking_rise) > 0:
            raise ValueError(f"hacking_rise must be > 0, got {self.hacking_rise!r}")


def _plain(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if not isinstance(node, dict):
        raise ValueError(f"must be a mapping of keys to values, got {node!r}")
    return dict(node)


def value_fits(hint: Any, value: Any) -> bool:
    """Whether a config value can be given where ``hint`` (a type annotation) is declared.

    Conservative: False only for a certain mismatch (a list where a ``str`` is declared, a
    string where an ``int`` is, a mapping where a ``bool`` is, ...); an annotation it does not
    understand, a string annotation, and a value still holding an interpolation (``${...}``)
    all fit. A list fits a declared ``tuple`` or ``Sequence``; an ``int`` fits a ``float``.
    """
    import collections.abc
    import types
    import typing
    from pathlib import PurePath

    if isinstance(value, str) and "${" in value:
        return True
    if hint is Any or isinstance(hint, (str, typing.ForwardRef, typing.TypeVar)):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(value_fits(a, value) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str or (isinstance(hint, type) and issubclass(hint, PurePath)):
        return isinstance(value, str)
    container = origin or hint
    if container in (list, tuple, set, frozenset, collections.abc.MutableSequence):
        return isinstance(value, (list, tuple))
    if container is collections.abc.Sequence:
        return isinstance(value, (list, tuple, str))
    if container in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        return isinstance(value, dict)
    return True


def _field_type_errors(cls: type, values: dict[str, Any], where: str) -> list[str]:
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 (an annotation that cannot be resolved is not checked)
        return []
    return [f"config key '{where}.{key}' must be {hint_name(hints[key])}, got {value!r}"
            for key, value in values.items()
            if key in hints and value is not None and not value_fits(hints[key], value)]


def hint_name(hint: Any) -> str:
    """A type annotation as an error message names it: ``int``, ``list[str]``,
    ``Optional[str]``."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def settings_from_config(cls: type[S], node: Any, where: str, *,
                         fallbacks: dict[str, Any] | None = None,
                         fixed: dict[str, Any] | None = None) -> S:
    """Build the settings dataclass ``cls`` from the config block ``node``.

    Args:
        cls: a settings dataclass (:class:`AdvantageSettings`, :class:`EvalSettings`).
        node: the block (a mapping, a ``DictConfig``, or None for all defaults).
        where: the block's config key, for error messages (``"advantages"``).
        fallbacks: values for keys the block leaves unset or null (e.g. the training
            ``max_generated_tokens`` for ``eval.max_generated_tokens``).
        fixed: values set by the recipe, not by the block (e.g. ``seed``); the block may not
            name them.

    Returns:
        The settings.

    Raises:
        ValueError: naming ``where.key``: an unknown key (with the closest known key
            suggested) or a value the settings reject.
    """
    fixed = fixed or {}
    values = _plain(node)
    allowed = [f.name for f in fields(cls) if f.init and f.name not in fixed]
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" Did you mean '{where}.{close[0]}'?" if close else ""
            known = ", ".join(allowed)
            raise ValueError(f"unknown config key '{where}.{key}' (known: {known}).{hint}")
    mistyped = _field_type_errors(cls, values, where)
    if mistyped:
        raise ValueError("; ".join(mistyped))
    for key, value in (fallbacks or {}).items():
        if values.get(key) is None:
            values[key] = value
    try:
        return cls(**values, **fixed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config key '{where}': {e}") from e
