"""The typed config tree's parts: field declarations, type checks, and the nested blocks.

Every key a recipe reads is a field of a dataclass: the top-level keys are the fields of the
trees in :mod:`torchtune_grpo.config.schema`, and a nested block of the config
(``advantages:``, ``run_health:``, ...) is a field whose type is one of the frozen settings
dataclasses here (or :class:`~torchtune_grpo.evaluation.settings.EvalSettings`). A top-level
field is declared with :func:`key` (its default, meaning and value check in the field's
metadata); :func:`keys_of` reads a tree into :class:`Key` s, from which the defaults, the
validation, ``tune-grpo validate`` and the docs' config table are derived.

:func:`settings_from_config` reads a nested block into its dataclass, rejecting unknown keys
with the closest known key suggested (``advantages.scael`` -> ``advantages.scale``) and checking
the values in the dataclass's ``__post_init__``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.algorithm.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    DEFAULT_EPS,
    DEFAULT_ESTIMATOR,
)

__all__ = ["REQUIRED", "AdvantageSettings", "Component", "DynamicSamplingSettings",
           "HealthSettings", "Key", "hint_name", "key", "keys_of", "settings_from_config",
           "type_name", "value_fits"]

S = TypeVar("S")

#: The default of a key that every config must set.
REQUIRED: Any = object()


class Component(dict):
    """The type of a config node that names a callable: a mapping whose ``_component_`` is the
    callable's dotted import path and whose other keys are its arguments (built by torchtune's
    ``config.instantiate``). Used as an annotation in the config tree."""


def key(default: Any, doc: str, check: Callable[[Any], str | None] | None = None) -> Any:
    """Declare a field of a config tree.

    Args:
        default: the value a config that omits the key gets, or :data:`REQUIRED`. A list or
            dict default is deep-copied for every use.
        doc: what the key means (the docs' config table and the missing-key error show it).
        check: returns what is wrong with a non-null, non-bool value of the right type
            (``"must be >= 1"``), or None.

    Returns:
        A :func:`dataclasses.field` carrying ``doc`` and ``check`` in its metadata.
    """
    metadata = {"doc": doc, "check": check}
    if default is REQUIRED:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Key:
    """One top-level key of a config tree, read from its dataclass field by :func:`keys_of`.

    Attributes:
        name: the key.
        hint: the field's type annotation (``int | None``, :class:`Component`, a settings
            dataclass for a nested block, ...).
        default: the value a config that omits the key gets, or :data:`REQUIRED`.
        doc: what the key means.
        check: returns what is wrong with a non-null value of the right type, or None.
    """

    name: str
    hint: Any
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None

    @property
    def type(self) -> str:
        """The accepted types as the config reference and error messages write them
        (:func:`type_name`: ``int|null``, ``component``, ``dict|null``)."""
        return type_name(self.hint)

    @property
    def settings(self) -> type | None:
        """The settings dataclass of a nested block (its fields are the block's keys), or
        None for a key that is not a nested block."""
        hints = typing.get_args(self.hint) or (self.hint,)
        return next((h for h in hints if dataclasses.is_dataclass(h)), None)


def keys_of(tree: type) -> dict[str, Key]:
    """The keys of a config tree (a dataclass whose fields are declared with :func:`key`), in
    field order.

    Raises:
        TypeError: ``tree`` is not a dataclass.
    """
    hints = typing.get_type_hints(tree)
    out = {}
    for f in fields(tree):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        out[f.name] = Key(f.name, hints[f.name], default, f.metadata.get("doc", ""),
                          f.metadata.get("check"))
    return out


def type_name(hint: Any) -> str:
    """A type annotation in the config's words: ``int | None`` -> ``int|null``,
    :class:`Component` -> ``component``, a list -> ``list``, a mapping or settings dataclass ->
    ``dict``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return "|".join(type_name(a) for a in args)
    if hint is type(None):
        return "null"
    if hint is Component:
        return "component"
    container = origin or hint
    if dataclasses.is_dataclass(hint) or container is dict:
        return "dict"
    if container in (list, tuple):
        return "list"
    return hint.__name__ if isinstance(hint, type) else str(hint)


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
    all fit. A list fits a declared ``tuple`` or ``Sequence``; an ``int`` fits a ``float``; a
    mapping fits a settings dataclass; :class:`Component` takes a mapping with
    ``_component_``. OmegaConf nodes count as the lists and mappings they hold.
    """
    import collections.abc
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
    is_list = isinstance(value, (list, tuple, ListConfig))
    is_mapping = isinstance(value, (dict, DictConfig))
    if hint is Component:
        return is_mapping and "_component_" in value
    if dataclasses.is_dataclass(hint):
        return is_mapping
    container = origin or hint
    if container in (list, tuple, set, frozenset, collections.abc.MutableSequence):
        return is_list
    if container is collections.abc.Sequence:
        return is_list or isinstance(value, str)
    if container in (dict, collections.abc.Mapping, collections.abc.MutableMapping):
        return is_mapping
    return True


def _field_type_errors(cls: type, values: dict[str, Any], where: str) -> list[str]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 (an annotation that cannot be resolved is not checked)
        return []
    return [f"config key '{where}.{key}' must be {type_name(hints[key])}, got {value!r}"
            for key, value in values.items()
            if key in hints and value is not None and not value_fits(hints[key], value)]


def hint_name(hint: Any) -> str:
    """A type annotation as an error message about a component's argument names it: ``int``,
    ``list[str]``, ``Optional[str]``."""
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
            name them, nor any field whose metadata has ``set_by_recipe``.

    Returns:
        The settings.

    Raises:
        ValueError: naming ``where.key``: an unknown key (with the closest known key
            suggested) or a value the settings reject.
    """
    fixed = fixed or {}
    values = _plain(node)
    allowed = [f.name for f in fields(cls)
               if f.init and f.name not in fixed and not f.metadata.get("set_by_recipe")]
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
