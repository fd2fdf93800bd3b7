"""The :class:`RewardSet`: reward components weighed and checked, scoring a batch.

Each :class:`RewardEntry` holds a component and the set's own keys of its config entry
(:data:`REWARD_ENTRY_KEYS`), checked in one place, :func:`check_reward_entry`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchtune_grpo.errors import ComponentError

__all__ = [
    "REWARD_ENTRY_KEYS",
    "RewardEntry",
    "RewardOutput",
    "RewardSet",
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

    ``weight`` (default 1.0) a finite number, ``name`` a non-empty string, ``success`` a bool,
    ``success_threshold`` a finite number, ``on_error`` ``raise`` (default) or ``zero``,
    ``requires_success`` a bool (default false).

    Args:
        entry: the entry, a mapping (``_component_`` is not checked here).
        where: how error messages name the entry, e.g. ``"rewards[0] (my.Reward)"``.

    Returns:
        ``(options, arguments)``: the set's options (``None`` for ``name``, ``success`` and
        ``success_threshold`` when unset) and the entry's other keys, the component's keyword
        arguments.

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
        success_threshold: a value ``>=`` this counts as success (success component only).
        on_error: ``"raise"`` or ``"zero"`` (a failing sample gets 0 and is counted).
        requires_success: a positive weighted value counts only where the completion succeeds;
            a negative one everywhere.
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
        total: ``[N]`` float32, the weighted sum of the components.
        components: name -> ``[N]`` float32 unweighted values of each component.
        success: ``[N]`` bool, the success component's value ``>=`` its threshold.
        errors: name -> samples that component failed on and scored 0 (``on_error: zero``).
        counts: ``"<name>/<counter>"`` -> the counters a component reported through
            :data:`COUNTS_ATTRIBUTE`; logged as ``reward/<name>/<counter>``.
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    success: torch.Tensor
    errors: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


#: A component may expose this attribute: a mapping counter name -> int describing its last
#: call (reset by the component at every call). :class:`RewardSet` sums it over the calls of
#: a batch into :attr:`RewardOutput.counts`, and the recipe logs every counter.
COUNTS_ATTRIBUTE = "last_counts"


def component_counts(fn: Any) -> dict[str, int]:
    """A component's :data:`COUNTS_ATTRIBUTE` as ``{name: int}`` (empty when it has none).

    Raises:
        TypeError: the attribute is not a mapping of names to integers.
    """
    counts = getattr(fn, COUNTS_ATTRIBUTE, None)
    if counts is None:
        return {}
    if not isinstance(counts, Mapping) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in counts.items()
    ):
        raise TypeError(
            f"reward component {fn!r}: `{COUNTS_ATTRIBUTE}` must map counter names (str) to "
            f"integers; got {counts!r}"
        )
    return dict(counts)


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

    Args:
        entries: the components, in order.
        success_name: name of the entry that defines success; default the first entry.

    Raises:
        ValueError: on no entries, duplicate names, an entry that :func:`check_reward_entry`
            rejects or an unknown ``success_name``.
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
            ComponentError: when a component with ``on_error: raise`` raises (a
                ``RuntimeError`` and a user error: one line); the message names
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
        counts: dict[str, int] = {}
        for entry in self.entries:
            values, n_errors, entry_counts = self._run(entry, completions, answers, kwargs)
            raw[entry.name] = values
            components[entry.name] = values.to(torch.float32)
            errors[entry.name] = n_errors
            counts.update({f"{entry.name}/{k}": v for k, v in entry_counts.items()})
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
            total=total.to(torch.float32), components=components, success=success, errors=errors,
            counts=counts,
        )

    def _run(
        self,
        entry: RewardEntry,
        completions: list[str],
        answers: list[str],
        kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, int, dict[str, int]]:
        """Call one component on the batch; returns ``([N] float64 values, error count,
        its counters)``."""
        n = len(completions)
        try:
            raw = entry.fn(completions, answers, **kwargs)
        except Exception as batch_exc:  # noqa: BLE001 - reported with context below
            return self._run_per_sample(entry, completions, answers, kwargs, batch_exc)
        values = self._validate(entry, raw, completions, n, offset=0)
        return values, 0, component_counts(entry.fn)

    def _run_per_sample(
        self,
        entry: RewardEntry,
        completions: list[str],
        answers: list[str],
        kwargs: Mapping[str, Any],
        batch_exc: Exception,
    ) -> tuple[torch.Tensor, int, dict[str, int]]:
        """After a batch call raised: score each sample alone to find (or zero) the failures
        (counters summed over the single-sample calls, the failed batch call's left out)."""
        n = len(completions)
        values = torch.zeros(n, dtype=torch.float64)
        n_errors = 0
        counts: dict[str, int] = {}

        def add_counts() -> None:
            for k, v in component_counts(entry.fn).items():
                counts[k] = counts.get(k, 0) + v

        for i in range(n):
            try:
                sample_kwargs = _slice_kwargs(kwargs, i, n)
                raw = entry.fn(completions[i : i + 1], answers[i : i + 1], **sample_kwargs)
            except Exception as exc:
                if entry.on_error == "zero":
                    n_errors += 1
                    add_counts()
                    continue
                raise ComponentError(
                    f"reward component {entry.name!r} raised {type(exc).__name__}: {exc} "
                    f"(first failing sample {i}: completion {_quote(completions[i])}, "
                    f"answer {_quote(answers[i])}). Fix the component, or set "
                    "`on_error: zero` on its config entry to score failing samples 0 "
                    "(TUNE_GRPO_DEBUG=1 shows its traceback)."
                ) from exc
            values[i] = self._validate(entry, raw, completions, 1, offset=i)[0]
            add_counts()
        if n_errors == 0 and entry.on_error == "raise":
            raise ComponentError(
                f"reward component {entry.name!r} raised {type(batch_exc).__name__}: {batch_exc} "
                "on the batch, but no single sample reproduces it (TUNE_GRPO_DEBUG=1 shows its "
                "traceback)."
            ) from batch_exc
        return values, n_errors, counts

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
