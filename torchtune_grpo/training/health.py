"""Run health: warnings computed from the step metrics that a reward curve hides.

A GRPO run can look busy and learn nothing. Three patterns are common and each shows in the
step metrics long before a held-out evaluation would say so:

- **no learning signal**: almost every group scored all its completions alike
  (``zero_std_group_fraction`` near 1) without being all right, so every advantage is 0 and
  the update does nothing. The cure is data or sampling: larger ``group_size``, prompts the
  model solves sometimes (``tune-grpo difficulty`` and a dataset's ``difficulty_file``), or
  ``dynamic_sampling``. Groups whose completions are *all right* (``solved_group_fraction``)
  tie too, but that is the task being solved, not a failure: when they are at least half of
  the tied groups the run says so once, as information (``solved``), and does not warn.
- **length collapse**: the mean response length falls to a fraction of where it started while
  the success rate does not rise: the policy is learning to say less, not to be right more
  often (the documented SmolLM2/GSM8K run: 144 -> 41 tokens, success flat).
- **reward hacking**: a reward component other than the success component rises while success
  stays flat: the policy is being paid for form, not for being right.

:class:`RunHealth` takes each step's metrics (the dict the recipe logs), keeps a short window of
them, and returns what changed: the conditions that turned on at this step (warned once, in the
log) and ``health/<condition>`` flags (0 or 1) that go into the metric log, so that
``tune-grpo plot`` can shade the steps where a condition held. :meth:`RunHealth.summary` says,
at the end of a run, which conditions held and over which steps. Thresholds are the fields of
:class:`~torchtune_grpo.config.settings.HealthSettings` (the ``run_health:`` config block;
``run_health: null`` turns it off).

Success means the success component's training reward (``success_rate``): noisy from step to
step, so every comparison is between window means: the first ``window`` steps of the run
against the latest ``window`` steps.
"""

from __future__ import annotations

from collections import deque

from torchtune_grpo.config.settings import HealthSettings

__all__ = ["CONDITIONS", "INFO_CONDITIONS", "HealthSettings", "RunHealth"]

#: The conditions, in the order they are reported, with the advice each warning gives.
CONDITIONS = {
    "no_signal": (
        "no learning signal: {value:.0%} of the groups of the last {window} steps scored all "
        "their completions alike (zero_std_group_fraction; all right in {solved:.0%}), so "
        "their advantages are 0. Raise group_size, train on prompts the model solves "
        "sometimes (tune-grpo difficulty, then the dataset's difficulty_file), or set "
        "dynamic_sampling."
    ),
    "length_collapse": (
        "response length collapse: mean length {value:.1f} tokens over the last {window} "
        "steps, {ratio:.0%} of the {start:.1f} of the first steps, while success_rate moved "
        "{gain:+.3f}. The policy is learning to say less, not to be right more often: check "
        "that no reward term pays short or formatted wrong answers."
    ),
    "reward_hacking": (
        "possible reward hacking: reward/{component} rose {rise:+.3f} since the first steps "
        "while success_rate moved {gain:+.3f}. A term other than success is driving the "
        "update; lower its weight, gate it on a correct answer, or make it a penalty only."
    ),
}


#: Conditions that are information, not a warning: logged once at INFO, never in the summary's
#: warnings (a solved task is what training is for).
INFO_CONDITIONS = {
    "solved": (
        "the task is solved on the training prompts: in {value:.0%} of the groups of the last "
        "{window} steps every completion was right (solved_group_fraction), so those groups "
        "tie and add no gradient. Further steps change little; evaluate, or move to harder "
        "prompts."
    ),
}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


class RunHealth:
    """Watches a run's step metrics and reports the conditions of the module docstring.

    Args:
        settings: the thresholds.
        success_component: name of the success reward component (its ``reward/<name>`` is
            never reported as hacking).
        gated_components: names of ``requires_success`` components, never reported as hacking
            either: they pay only alongside success, so their logged (unweighted, ungated)
            value can rise while no wrong answer earns anything for it (e.g. a reply that ends
            on the answer sentence more often, right or wrong).

    The first window (the baseline) is kept from the first steps :meth:`update` sees. A resumed
    run starts a new baseline at its first step.
    """

    def __init__(self, settings: HealthSettings, success_component: str | None = None,
                 gated_components: tuple[str, ...] | list[str] = ()) -> None:
        self.settings = settings
        self.success_component = success_component
        self.gated_components = tuple(gated_components)
        self._first: list[dict[str, float]] = []
        self._recent: deque[dict[str, float]] = deque(maxlen=settings.window)
        self._active: dict[str, bool] = {name: False for name in (*CONDITIONS,
                                                                   *INFO_CONDITIONS)}
        #: condition -> list of ``[first_step, last_step]`` spans where it held
        self.spans: dict[str, list[list[int]]] = {name: [] for name in CONDITIONS}
        #: ``[first_step, last_step]`` spans of the information conditions (``solved``)
        self.info_spans: dict[str, list[list[int]]] = {name: [] for name in INFO_CONDITIONS}
        #: information messages that turned on at the last :meth:`update` (log them at INFO)
        self.info: list[str] = []
        self._steps_seen = 0

    def _baseline(self, key: str) -> float | None:
        values = [m[key] for m in self._first if key in m]
        return _mean(values) if len(values) == len(self._first) and values else None

    def _latest(self, key: str) -> float | None:
        values = [m[key] for m in self._recent if key in m]
        return _mean(values) if len(values) == len(self._recent) and values else None

    def check(self) -> dict[str, str]:
        """The conditions that hold over the current window, each with its message."""
        s = self.settings
        held: dict[str, str] = {}
        if len(self._recent) < s.window:
            return held
        zero = self._latest("zero_std_group_fraction")
        solved = self._latest("solved_group_fraction") or 0.0
        if zero is not None and zero >= s.no_signal_fraction:
            if solved >= 0.5 * zero:  # the ties are mostly groups with every completion right
                held["solved"] = INFO_CONDITIONS["solved"].format(value=solved,
                                                                  window=s.window)
            else:
                held["no_signal"] = CONDITIONS["no_signal"].format(value=zero, solved=solved,
                                                                  window=s.window)
        if self._steps_seen < 2 * s.window:
            return held
        success_now, success_then = self._latest("success_rate"), self._baseline("success_rate")
        if success_now is None or success_then is None:
            return held
        gain = success_now - success_then
        if gain >= s.min_success_gain:
            return held
        length_now = self._latest("response_length/mean")
        length_then = self._baseline("response_length/mean")
        if length_now is not None and length_then and \
                length_now <= s.length_collapse_ratio * length_then:
            held["length_collapse"] = CONDITIONS["length_collapse"].format(
                value=length_now, window=s.window, ratio=length_now / length_then,
                start=length_then, gain=gain)
        rises = []
        for key in sorted(self._recent[-1]):
            if not key.startswith("reward/") or key.count("/") != 1 or key in (
                    "reward/mean", "reward/std", f"reward/{self.success_component}") or \
                    key.split("/", 1)[1] in self.gated_components:
                continue
            now, then = self._latest(key), self._baseline(key)
            if now is not None and then is not None and now - then >= s.hacking_rise:
                rises.append((now - then, key.split("/", 1)[1]))
        if rises:
            rise, component = max(rises)
            held["reward_hacking"] = CONDITIONS["reward_hacking"].format(
                component=component, rise=rise, gain=gain)
        return held

    def update(self, step: int, metrics: dict[str, float]) -> tuple[dict[str, float], list[str]]:
        """Take one step's metrics.

        Args:
            step: the step number (for the spans of :meth:`summary`).
            metrics: the step's logged metrics (``zero_std_group_fraction``,
                ``success_rate``, ``response_length/mean``, ``reward/<name>``).

        Returns:
            ``(flags, warnings)``: ``{"health/<condition>": 0.0 | 1.0}`` for every condition,
            and the messages of the conditions that turned on at this step (each is said once
            until it clears).
        """
        plain = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if len(self._first) < self.settings.window:
            self._first.append(plain)
        self._recent.append(plain)
        self._steps_seen += 1
        held = self.check()
        warnings: list[str] = []
        self.info = []
        for name in (*CONDITIONS, *INFO_CONDITIONS):
            spans = self.spans if name in CONDITIONS else self.info_spans
            said = warnings if name in CONDITIONS else self.info
            now = name in held
            if now and not self._active[name]:
                if not (name in INFO_CONDITIONS and spans[name]):  # information: said once
                    said.append(f"step {step}: {held[name]}")
                spans[name].append([step, step])
            elif now:
                spans[name][-1][1] = step
            self._active[name] = now
        flags = {f"health/{name}": float(self._active[name])
                 for name in (*CONDITIONS, *INFO_CONDITIONS)}
        return flags, warnings

    def summary(self) -> str:
        """One paragraph for the end of a run: each condition that held, and its steps."""
        lines = []
        for name, spans in self.spans.items():
            if spans:
                where = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
                lines.append(f"  {name}: steps {where}")
        solved = ""
        if self.info_spans["solved"]:
            solved = (f"; the task was solved on the training prompts from step "
                      f"{self.info_spans['solved'][0][0]} (solved_group_fraction)")
        if not lines:
            return ("run health: no warnings (no_signal, length_collapse, reward_hacking)"
                    + solved)
        return ("run health: these conditions held (see the warnings above):\n"
                + "\n".join(lines) + solved)
