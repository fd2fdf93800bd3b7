"""The :class:`RewardSet`: reward components weighed, checked and built from a config.

:func:`build_reward_set` turns the ``rewards`` list of a config into a :class:`RewardSet`. Each
entry names a reward component (see :mod:`torchtune_grpo.rewards.components` for the signature and
the shipped ones) with ``_component_`` and holds the keys of :data:`REWARD_ENTRY_KEYS`, which
belong to the set, not to the component: ``weight``, ``name``, ``success``,
``success_threshold``, ``on_error`` and ``requires_success``. :func:`check_reward_entry` is the
one place those keys are checked: by :func:`build_reward_set`, by :class:`RewardSet` for entries
made in code, and by :func:`torchtune_grpo.training.config.validate_config` before any model is loaded.

The :class:`RewardSet` applies the weights, validates every component's output and turns
exceptions into messages that name the component and the sample.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = [
    "REWARD_ENTRY_KEYS",
    "RewardEntry",
    "RewardOutput",
    "RewardSet",
    "build_reward_set",
    "check_reward_entry",
]

#: Default threshold above which the success component counts a completion as a success.
DEFAULT_SUCCESS_THRESHOLD = 1.0 - 1e-6
#: Keys of a ``rewards`` config entry that the reward set consumes; every other key of the
#: entry is a keyword argument of the component.
REWARD_ENTRY_KEYS = frozenset(
    {"_component_", "weight", "name", "success", "success_threshold", "on_error",
     "requires_success"}
)
#: Accepted ``on_error`` values.
ON_ERROR = ("raise", "zero")
#: Characters of a completion quoted in error messages.
_QUOTE_CHARS = 200

RewardFn = Callable[..., "Sequence[float] | torch.Tensor"]


# --------------------------------------------------------------------------------------------
# One entry
# --------------------------------------------------------------------------------------------


def check_reward_entry(
    entry: Mapping[str, Any], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the reward-set keys (:data:`REWARD_ENTRY_KEYS`) of one ``rewards`` entry.

    - ``weight`` (default 1.0): a finite number multiplying the component in the total reward.
    - ``name``: a non-empty string (default: chosen by :func:`build_reward_set`).
    - ``success``: ``true`` or ``false``.
    - ``success_threshold``: a finite number.
    - ``on_error``: ``raise`` (default) or ``zero``.
    - ``requires_success``: ``true`` or ``false`` (default).

    Checks that involve several entries (one ``success: true``, distinct names) are made by
    :func:`build_reward_set` and :class:`RewardSet`.

    Args:
        entry: the entry, a mapping (``_component_`` is not checked here).
        where: how error messages name the entry, e.g. ``"rewards[0] (my.Reward)"``.

    Returns:
        ``(options, arguments)``: ``options`` maps ``weight``, ``name``, ``success``,
        ``success_threshold`` and ``on_error`` to their values (``None`` for ``name``,
        ``success`` and ``success_threshold`` when the entry does not set them);
        ``arguments`` holds the entry's other keys, the component's keyword arguments.

    Raises:
        ValueError: naming ``where`` and the key, on a value of the wrong type or out of range.
    """
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise ValueError(f"{where}: `weight` must be a number, got {weight!r}")
    if not math.isfinite(weight):
        raise ValueError(f"{where}: `weight` must be finite, got {weight!r}")
    name = entry.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{where}: `name` must be a non-empty string, got {name!r}")
    success = entry.get("success")
    if success is not None and not isinstance(success, bool):
        raise ValueError(f"{where}: `success` must be true or false, got {success!r}")
    threshold = entry.get("success_threshold")
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, numbers.Real)
        or not math.isfinite(threshold)
    ):
        raise ValueError(
            f"{where}: `success_threshold` must be a finite number, got {threshold!r}"
        )
    on_error = entry.get("on_error", "raise")
    if on_error not in ON_ERROR:
        raise ValueError(f"{where}: `on_error` must be 'raise' or 'zero', got {on_error!r}")
    requires_success = entry.get("requires_success", False)
    if not isinstance(requires_success, bool):
        raise ValueError(
            f"{where}: `requires_success` must be true or false, got {requires_success!r}")
    if requires_success and success is True:
        raise ValueError(f"{where}: `requires_success` cannot be set on the success entry itself")
    options = {
        "weight": float(weight),
        "requires_success": requires_success,
        "name": name,
        "success": success,
        "success_threshold": None if threshold is None else float(threshold),
        "on_error": on_error,
    }
    arguments = {k: v for k, v in entry.items() if k not in REWARD_ENTRY_KEYS}
    return options, arguments


@dataclass
class RewardEntry:
    """One configured reward component.

    Attributes:
        name: the component's name (metric ``reward/<name>``).
        fn: the component callable.
        weight: its weight in the total reward.
        success_threshold: a value ``>=`` this counts as success (used only for the success
            component).
        on_error: ``"raise"`` (an exception stops the step) or ``"zero"`` (a sample whose scoring
            raises gets 0 and is counted in :attr:`RewardOutput.errors`).
        requires_success: the term pays only completions that succeed: a positive weighted
            value counts in the total only where the success component says success; a
            negative one (a penalty) counts everywhere. For shaping terms (format, style), so
            that a wrong answer is never paid for its form.
    """

    name: str
    fn: RewardFn
    weight: float = 1.0
    success_threshold: float = DEFAULT_SUCCESS_THRESHOLD
    on_error: str = "raise"
    requires_success: bool = False


@dataclass
class RewardOutput:
    """Scores of a batch of ``N`` completions.

    Attributes:
        total: ``[N]`` float32, the weighted sum of the components (a ``requires_success``
            component's positive part only where ``success``).
        components: name -> ``[N]`` float32 unweighted values of each component.
        success: ``[N]`` bool, the success component's value ``>=`` its threshold.
        errors: name -> number of samples that component failed on and scored 0
            (only components with ``on_error: zero`` can have non-zero counts).
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    success: torch.Tensor
    errors: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# RewardSet
# --------------------------------------------------------------------------------------------


def _quote(text: Any) -> str:
    """``repr`` of ``text``, cut to :data:`_QUOTE_CHARS` characters for error messages."""
    text = str(text)
    if len(text) > _QUOTE_CHARS:
        text = text[:_QUOTE_CHARS] + f"... [{len(text) - _QUOTE_CHARS} more chars]"
    return repr(text)


def _slice_kwargs(kwargs: Mapping[str, Any], i: int, n: int) -> dict[str, Any]:
    """Per-sample kwargs: length-``n`` lists/tuples/tensors are cut to ``[i:i+1]``."""
    out = {}
    for key, value in kwargs.items():
        sliceable = isinstance(value, list | tuple) or (
            isinstance(value, torch.Tensor) and value.dim() > 0
        )
        if sliceable and len(value) == n:
            out[key] = value[i : i + 1]
        else:
            out[key] = value
    return out


class RewardSet:
    """Weighted reward components with one designated success component.

    Build it from a config with :func:`build_reward_set`, or directly from
    :class:`RewardEntry` objects.

    Args:
        entries: the components, in order.
        success_name: name of the entry that defines success; default the first entry.

    Raises:
        ValueError: on no entries, duplicate names, an entry that
            :func:`check_reward_entry` rejects (e.g. a non-finite weight or an unknown
            ``on_error``) or an unknown ``success_name``.
    """

    def __init__(self, entries: Sequence[RewardEntry], success_name: str | None = None) -> None:
        if not entries:
            raise ValueError("RewardSet needs at least one reward component")
        seen: dict[str, int] = {}
        for i, entry in enumerate(entries):
            check_reward_entry(
                {"name": entry.name, "weight": entry.weight, "on_error": entry.on_error,
                 "success_threshold": entry.success_threshold},
                f"rewards[{i}] ({entry.name})",
            )
            if entry.name in seen:
                raise ValueError(
                    f"rewards[{i}]: `name` {entry.name!r} is already used by "
                    f"rewards[{seen[entry.name]}] (duplicate reward name); give one of them a "
                    "distinct `name:`"
                )
            seen[entry.name] = i
        self.entries = list(entries)
        if success_name is None:
            success_name = self.entries[0].name
        if success_name not in seen:
            raise ValueError(f"success component {success_name!r} is not one of {sorted(seen)}")
        self._success_name = success_name

    @property
    def names(self) -> list[str]:
        """Names of the components, in config order."""
        return [e.name for e in self.entries]

    @property
    def weights(self) -> dict[str, float]:
        """Name -> weight of every component."""
        return {e.name: e.weight for e in self.entries}

    @property
    def success_name(self) -> str:
        """Name of the component that defines success."""
        return self._success_name

    def __repr__(self) -> str:
        parts = ", ".join(f"{e.name}*{e.weight:g}" for e in self.entries)
        return f"RewardSet({parts}; success={self._success_name})"

    def __call__(
        self, completions: Sequence[str], answers: Sequence[str], **kwargs: Any
    ) -> RewardOutput:
        """Score ``N`` completions with every component.

        Args:
            completions: ``N`` decoded completions.
            answers: ``N`` gold answers.
            **kwargs: passed to every component (``questions``, ``stopped``,
                ``response_lengths``, ``max_generated_tokens``, ...).

        Returns:
            A :class:`RewardOutput` with ``[N]`` tensors.

        Raises:
            ValueError: when ``completions`` and ``answers`` differ in length, or a component
                returns the wrong length, a non-numeric or a non-finite value.
            RuntimeError: when a component with ``on_error: raise`` raises; the message names
                the component and the first sample that fails on its own.
        """
        completions, answers = list(completions), list(answers)
        n = len(completions)
        if len(answers) != n:
            raise ValueError(
                f"RewardSet: got {n} completions but {len(answers)} answers; they must match"
            )
        components: dict[str, torch.Tensor] = {}
        raw: dict[str, torch.Tensor] = {}
        errors: dict[str, int] = {}
        for entry in self.entries:
            values, n_errors = self._run(entry, completions, answers, kwargs)
            raw[entry.name] = values
            components[entry.name] = values.to(torch.float32)
            errors[entry.name] = n_errors
        success_entry = next(e for e in self.entries if e.name == self._success_name)
        success = components[success_entry.name] >= success_entry.success_threshold
        total = torch.zeros(n, dtype=torch.float64)
        for entry in self.entries:
            weighted = entry.weight * raw[entry.name]
            if entry.requires_success:  # bonuses only where right, penalties everywhere
                weighted = torch.where((weighted > 0) & ~success, torch.zeros_like(weighted),
                                       weighted)
            total += weighted
        return RewardOutput(
            total=total.to(torch.float32), components=components, success=success, errors=errors
        )

    def _run(
        self,
        entry: RewardEntry,
        completions: list[str],
        answers: list[str],
        kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, int]:
        """Call one component on the batch; returns ``([N] float64 values, error count)``."""
        n = len(completions)
        try:
            raw = entry.fn(completions, answers, **kwargs)
        except Exception as batch_exc:  # noqa: BLE001 - reported with context below
            return self._run_per_sample(entry, completions, answers, kwargs, batch_exc)
        return self._validate(entry, raw, completions, n, offset=0), 0

    def _run_per_sample(
        self,
        entry: RewardEntry,
        completions: list[str],
        answers: list[str],
        kwargs: Mapping[str, Any],
        batch_exc: Exception,
    ) -> tuple[torch.Tensor, int]:
        """After a batch call raised: score each sample alone to find (or zero) the failures."""
        n = len(completions)
        values = torch.zeros(n, dtype=torch.float64)
        n_errors = 0
        for i in range(n):
            try:
                sample_kwargs = _slice_kwargs(kwargs, i, n)
                raw = entry.fn(completions[i : i + 1], answers[i : i + 1], **sample_kwargs)
            except Exception as exc:
                if entry.on_error == "zero":
                    n_errors += 1
                    continue
                raise RuntimeError(
                    f"reward component {entry.name!r} raised {type(exc).__name__}: {exc} "
                    f"(first failing sample {i}: completion {_quote(completions[i])}, "
                    f"answer {_quote(answers[i])}). Fix the component, or set "
                    "`on_error: zero` on its config entry to score failing samples 0."
                ) from exc
            values[i] = self._validate(entry, raw, completions, 1, offset=i)[0]
        if n_errors == 0 and entry.on_error == "raise":
            raise RuntimeError(
                f"reward component {entry.name!r} raised {type(batch_exc).__name__}: {batch_exc} "
                "on the batch, but no single sample reproduces it."
            ) from batch_exc
        return values, n_errors

    @staticmethod
    def _validate(
        entry: RewardEntry, raw: Any, completions: list[str], n: int, offset: int
    ) -> torch.Tensor:
        """Check a component's output and convert it to a ``[n]`` float64 tensor."""
        where = f"reward component {entry.name!r}"
        if isinstance(raw, torch.Tensor):
            if raw.dim() != 1 or raw.shape[0] != n:
                raise ValueError(
                    f"{where} returned a tensor of shape {tuple(raw.shape)}; expected [{n}] "
                    "(one value per completion)"
                )
            if raw.is_complex():
                raise ValueError(f"{where} returned a {raw.dtype} tensor; expected real numbers")
            values = raw.detach().to("cpu", torch.float64)
        else:
            if isinstance(raw, str | bytes | Mapping) or not hasattr(raw, "__iter__"):
                raise ValueError(
                    f"{where} returned {type(raw).__name__}; expected a sequence of {n} floats "
                    "or a [N] tensor"
                )
            raw = list(raw)
            if len(raw) != n:
                raise ValueError(
                    f"{where} returned {len(raw)} values for {n} completions; expected one "
                    "value per completion"
                )
            floats = []
            for j, v in enumerate(raw):
                if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
                    v = v.item()
                if not isinstance(v, numbers.Real):
                    raise ValueError(
                        f"{where} returned a non-numeric value {v!r} "
                        f"({type(v).__name__}) for sample {offset + j}; expected a float"
                    )
                floats.append(float(v))
            values = torch.tensor(floats, dtype=torch.float64)
        bad = (~torch.isfinite(values)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            raise ValueError(
                f"{where} returned a non-finite value {values[j].item()} for sample {offset + j} "
                f"(completion {_quote(completions[offset + j])}); rewards must be finite"
            )
        return values


# --------------------------------------------------------------------------------------------
# Building from a config
# --------------------------------------------------------------------------------------------


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
    """Build a :class:`RewardSet` from the ``rewards`` list of a config.

    Each entry is a mapping with ``_component_`` (dotted path of a reward class, a factory, or a
    plain function whose first two parameters are ``completions, answers``) plus keyword
    arguments for it. The keys of :data:`REWARD_ENTRY_KEYS` are taken out of the entry before
    instantiating it (checked by :func:`check_reward_entry`):

    - ``weight`` (default 1.0): finite number multiplying the component in the total reward.
    - ``name``: metric name (``reward/<name>``); default the component's ``name`` attribute,
      else the snake_case class (or function) name.
    - ``success`` (bool): this component defines ``success_rate`` (at most one entry). If no
      entry sets ``success: true``, the first entry not marked ``success: false`` does.
    - ``success_threshold`` (default ``1 - 1e-6``): value from which a sample counts as success;
      only on the success entry.
    - ``on_error``: ``raise`` (default) or ``zero`` (score samples whose scoring raises 0 and
      count them in :attr:`RewardOutput.errors`).
    - ``requires_success`` (default false): the term's positive values count in the total only
      for completions that succeed (see :class:`RewardEntry`); not on the success entry.

    Args:
        cfg_list: an OmegaConf ``ListConfig`` or a list of dicts.

    Returns:
        The :class:`RewardSet`.

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
