"""Tests of answer parsing (rewards.answers), the shipped components (rewards.components), RewardSet
(rewards.reward_set)."""

from __future__ import annotations

import math
import random
import time
from typing import ClassVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from torchtune_grpo.rewards.answers import extract_tagged, numbers_match, parse_number
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.rewards.components import FormatReward, NumericCorrectness
from torchtune_grpo.rewards.reward_set import RewardEntry, RewardSet

# ------------------------------------------------------------------ user-defined components
# Plugged in below purely by their `_component_` path, as a user's own module would be.


class ShoutReward:
    """1.0 for completions written in capitals (a user-defined component)."""

    def __init__(self, min_length: int = 1) -> None:
        self.min_length = min_length

    def __call__(self, completions, answers, **kwargs):
        return [1.0 if len(c) >= self.min_length and c.isupper() else 0.0 for c in completions]


def length_bonus(completions, answers, scale: float = 1.0, **kwargs):
    """A plain reward function: the first two parameters mark it as a reward, not a factory."""
    return torch.tensor([scale * len(c) for c in completions])


class KwargsRecorder:
    """Records the keyword arguments it was called with."""

    name = "recorder"
    calls: ClassVar[list[dict]] = []

    def __call__(self, completions, answers, **kwargs):
        KwargsRecorder.calls.append(kwargs)
        return [0.0] * len(completions)


class FailsOn:
    """Raises on completions containing ``marker``."""

    def __init__(self, marker: str = "boom") -> None:
        self.marker = marker

    def __call__(self, completions, answers, **kwargs):
        if any(self.marker in c for c in completions):
            raise KeyError(self.marker)
        return [1.0] * len(completions)


class Returns:
    """Returns a fixed value regardless of the batch."""

    def __init__(self, value=None) -> None:
        self.value = value

    def __call__(self, completions, answers, **kwargs):
        return self.value


class NaNOnSecond:
    def __call__(self, completions, answers, **kwargs):
        return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


HERE = __name__


def _path(obj) -> str:
    return f"{HERE}.{obj.__name__}"


# ------------------------------------------------------------------------------ parse_number


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", 18.0),
        ("1,000", 1000.0),
        ("1000", 1000.0),
        ("1,234,567", 1234567.0),
        ("$18", 18.0),
        ("$1,000.50", 1000.5),
        ("18.00", 18.0),
        ("18.", 18.0),
        ("The answer is 18.", 18.0),
        ("18 dollars", 18.0),
        ("$18 per hour", 18.0),
        ("-5", -5.0),
        ("x = -5", -5.0),
        ("-$5", -5.0),
        ("(-3)", -3.0),
        ("\u22127", -7.0),
        ("10-3", 3.0),
        ("10 - 3", 3.0),
        ("3/4", 0.75),
        ("\\frac{3}{4}", 0.75),
        ("\\dfrac{-1}{2}", -0.5),
        ("\\boxed{42}", 42.0),
        ("50%", 50.0),
        (".5", 0.5),
        ("1{,}000", 1000.0),
        ("1,2,3", 3.0),
        ("first 4 then 7 apples", 7.0),
        ("1/0", 0.0),
        ("", None),
        ("no number here", None),
        ("...", None),
        ("9" * 500, None),  # not finite as a float
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_numbers_match():
    assert numbers_match(18.0, 18.0)
    assert numbers_match(0.75, 3 / 4)
    assert numbers_match(0.3333333333, 1 / 3)  # relative tolerance
    assert not numbers_match(1450000.0, 1450001.0)  # whole numbers must be equal
    assert numbers_match(0.0, 1e-12)  # absolute tolerance near zero
    assert not numbers_match(18.0, 19.0)
    assert not numbers_match(0.0, 0.001)
    assert not numbers_match(float("nan"), float("nan"))


def test_extract_tagged():
    assert extract_tagged("<answer>18</answer>", "answer") == "18"
    assert extract_tagged("<answer> 18 </answer>", "answer") == "18"
    assert extract_tagged("<answer>5</answer> then <answer>7</answer>", "answer") == "7"
    assert extract_tagged("<answer>5</answer> <answer>9", "answer") == "5"  # unclosed last
    assert extract_tagged("<ANSWER>3</Answer>", "answer") == "3"
    assert extract_tagged("<answer></answer>", "answer") == ""
    assert extract_tagged("no tags", "answer") is None
    assert extract_tagged("18</answer>", "answer") is None
    assert extract_tagged("<res>2</res>", "res") == "2"


# ------------------------------------------------------------------------ NumericCorrectness


def _tagged(x: str) -> str:
    return f"<think>some reasoning with 3 numbers 4 5</think>\n<answer>{x}</answer>"


@pytest.mark.parametrize(
    ("answer_text", "gold", "expected"),
    [
        ("18", "18", 1.0),
        ("1,000", "1000", 1.0),
        ("1000", "1,000", 1.0),
        ("$18", "18", 1.0),
        ("18.00", "18", 1.0),
        ("18.", "18", 1.0),
        ("18 dollars", "18", 1.0),
        ("$18 per hour", "18", 1.0),
        ("The answer is 18.", "18", 1.0),
        ("-7", "-7", 1.0),
        ("3/4", "0.75", 1.0),
        ("0.75", "3/4", 1.0),
        ("50%", "50", 1.0),
        ("0.5", "0.5", 1.0),
        ("17", "18", 0.0),
        ("7", "-7", 0.0),
        ("18.5", "18", 0.0),
        ("", "18", 0.0),
        ("eighteen", "18", 0.0),
    ],
)
def test_numeric_correctness_cases(answer_text, gold, expected):
    assert NumericCorrectness()([_tagged(answer_text)], [gold]) == [expected]


def test_numeric_correctness_tags_and_fallback():
    strict = NumericCorrectness()
    loose = NumericCorrectness(fallback="last_number")
    untagged = NumericCorrectness(answer_tag=None)
    no_tag = "so the total is 18"
    assert strict([no_tag], ["18"]) == [0.0]
    assert loose([no_tag], ["18"]) == [1.0]
    assert untagged([no_tag], ["18"]) == [1.0]
    # Multiple answer tags: the last one wins.
    two = "<answer>5</answer> wait, no: <answer>18</answer>"
    assert strict([two], ["18"]) == [1.0]
    assert strict([two], ["5"]) == [0.0]
    # With a tag present, the fallback does not look outside it.
    assert loose(["18 <answer>none</answer>"], ["18"]) == [0.0]
    # Without the tag, the last number of the whole text counts (numbers after the tag too).
    assert untagged(["<answer>18</answer> (checked 3 times)"], ["18"]) == [0.0]
    # A custom tag name.
    assert NumericCorrectness(answer_tag="final")(["<final>4</final>"], ["4"]) == [1.0]
    # Batches keep order.
    assert strict([_tagged("1"), _tagged("2"), "x"], ["1", "3", "1"]) == [1.0, 0.0, 0.0]


def test_numeric_correctness_bad_config_and_gold():
    with pytest.raises(ValueError, match="fallback"):
        NumericCorrectness(fallback="first_number")
    with pytest.raises(ValueError, match="answer_tag"):
        NumericCorrectness(answer_tag="")
    with pytest.raises(ValueError, match="gold answer 'abc' of sample 0"):
        NumericCorrectness()(["<answer>1</answer>"], ["abc"])


# ------------------------------------------------------------------------------ FormatReward


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>reason</think><answer>18</answer>", 1.0),
        ("  <think>\nreason\n</think>\n<answer> 18 </answer>\n", 1.0),
        ("<think>reason</think><answer>18</answer><|eot_id|>", 1.0),
        ("<think>reason</think><answer>18</answer> and more text", 0.5),
        ("<answer>18</answer>", 0.5),  # think block required
        ("intro <think>reason</think><answer>18</answer>", 0.5),
        ("<think></think><answer>18</answer>", 0.5),  # empty reasoning
        ("<think>a</think><think>b</think><answer>18</answer>", 0.5),
        ("<think>reason<answer>18</answer>", 0.5),  # think never closed
        ("<think>reason</think><answer> </answer>", 0.0),  # empty answer
        ("<think>reason</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think>reason</think></answer>18<answer>", 0.0),
        ("<think>reason</think> 18", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert FormatReward()([completion], ["18"]) == [expected]


def test_format_reward_options():
    no_think = FormatReward(require_think=False)
    assert no_think(["<answer>18</answer>"], [""]) == [1.0]
    assert no_think(["<think>r</think><answer>18</answer>"], [""]) == [1.0]
    assert no_think(["text <answer>18</answer>"], [""]) == [0.5]
    # The prompt pre-fills "<think>": the completion lacks the opening tag.
    prefixed = FormatReward(prefix="<think>")
    assert prefixed(["reasoning</think><answer>3</answer>"], [""]) == [1.0]
    assert FormatReward()(["reasoning</think><answer>3</answer>"], [""]) == [0.5]
    custom = FormatReward(think_tag="reasoning", answer_tag="final")
    assert custom(["<reasoning>r</reasoning><final>3</final>"], [""]) == [1.0]
    with pytest.raises(ValueError, match="distinct"):
        FormatReward(think_tag="x", answer_tag="x")


# --------------------------------------------------------------------------------- fuzzing

_MATHY = st.text(
    alphabet=st.sampled_from(list("0123456789,.-/$%{}\\ frac<>/answerthink\n\u2212xé")),
    max_size=300,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=300), _MATHY), gold=st.sampled_from(["18", "1,000", "-3"]))
def test_fuzz_never_raises(text, gold):
    value = parse_number(text)
    assert value is None or math.isfinite(value)
    extract_tagged(text, "answer")
    for component in (
        NumericCorrectness(),
        NumericCorrectness(fallback="last_number"),
        NumericCorrectness(answer_tag=None),
    ):
        assert component([text], [gold]) in ([0.0], [1.0])
    assert FormatReward()([text], [gold])[0] in (0.0, 0.5, 1.0)


@settings(max_examples=200, deadline=None)
@given(number=st.integers(-(10**12), 10**12), noise=st.text(alphabet="abc xyz:=!?\n", max_size=40))
def test_fuzz_number_roundtrip(number, noise):
    """A number written with thousands separators at the end of noise is read back exactly."""
    written = f"{number:,}"
    assert parse_number(f"{noise} {written}") == float(number)
    assert NumericCorrectness()([f"{noise}<answer>{written}</answer>"], [str(number)]) == [1.0]


_PATHOLOGICAL = [
    "1," * 50_000,
    "1." * 50_000,
    ".1" * 50_000,
    "1/" * 50_000,
    "-1" * 50_000,
    "-" * 100_000,
    "$" * 100_000,
    " " * 100_000,
    "9" * 100_000,
    "\\frac{" * 16_000,
    "\\frac{1}{" * 11_000,
    "<answer>" * 12_500,
    "</answer>" * 11_000,
    "<answer>1" * 11_000,
    "<think>" * 14_000,
    "1 /" * 33_000,
]


@pytest.mark.parametrize("index", range(len(_PATHOLOGICAL) + 1))
def test_pathological_inputs_are_fast(index):
    if index < len(_PATHOLOGICAL):
        text = _PATHOLOGICAL[index]
    else:
        rng = random.Random(0)
        text = "".join(chr(rng.randrange(32, 0x3000)) for _ in range(100_000))
    components = [
        NumericCorrectness(),
        NumericCorrectness(fallback="last_number"),
        NumericCorrectness(answer_tag=None),
        FormatReward(),
    ]
    for component in components:
        start = time.perf_counter()
        scores = component([text], ["1"])
        elapsed = time.perf_counter() - start
        assert scores[0] in (0.0, 0.5, 1.0)
        assert elapsed < 0.1, f"{type(component).__name__} took {elapsed:.3f}s"


# --------------------------------------------------------------------------------- RewardSet


def _cfg(entries):
    return OmegaConf.create(entries)


CORRECT = "torchtune_grpo.rewards.components.NumericCorrectness"
FORMAT = "torchtune_grpo.rewards.components.FormatReward"


def test_reward_set_weighting_and_success():
    rewards = build_reward_set(
        _cfg(
            [
                {"_component_": CORRECT, "weight": 1.0, "success": True},
                {"_component_": FORMAT, "weight": 0.1, "name": "fmt"},
            ]
        )
    )
    assert rewards.names == ["correctness", "fmt"]
    assert rewards.success_name == "correctness"
    assert rewards.weights == {"correctness": 1.0, "fmt": 0.1}
    completions = [
        "<think>r</think><answer>18</answer>",  # correct, formatted
        "<answer>18</answer>",  # correct, half format
        "<think>r</think><answer>17</answer>",  # wrong, formatted
        "18",  # wrong (no tag), no format
    ]
    out = rewards(completions, ["18"] * 4, questions=["q"] * 4, stopped=[True] * 4)
    assert out.total.dtype == torch.float32 and out.total.shape == (4,)
    torch.testing.assert_close(out.total, torch.tensor([1.1, 1.05, 0.1, 0.0]))
    torch.testing.assert_close(out.components["correctness"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(out.components["fmt"], torch.tensor([1.0, 0.5, 1.0, 0.0]))
    assert out.success.dtype == torch.bool
    assert out.success.tolist() == [True, True, False, False]
    assert out.errors == {"correctness": 0, "fmt": 0}


def test_reward_set_defaults_and_list_of_dicts():
    rewards = build_reward_set([{"_component_": FORMAT}, {"_component_": CORRECT, "weight": 2}])
    assert rewards.success_name == "format"  # first entry defines success by default
    out = rewards(["<answer>1</answer>"], ["1"])
    assert out.total.item() == pytest.approx(0.5 + 2.0)
    assert out.success.tolist() == [False]  # 0.5 < default threshold
    # success_threshold on the success entry.
    rewards = build_reward_set([{"_component_": FORMAT, "success_threshold": 0.5}])
    assert rewards(["<answer>1</answer>"], ["1"]).success.tolist() == [True]
    # success on a later entry, and success: false skips an entry for the default.
    rewards = build_reward_set(
        [{"_component_": FORMAT, "success": False}, {"_component_": CORRECT}]
    )
    assert rewards.success_name == "correctness"


def test_user_component_by_path():
    rewards = build_reward_set(
        _cfg(
            [
                {"_component_": _path(ShoutReward), "min_length": 2, "success": True},
                {"_component_": _path(length_bonus), "scale": 0.5, "weight": 0.0},
            ]
        )
    )
    assert rewards.names == ["shout_reward", "length_bonus"]
    out = rewards(["HELLO", "hi", "A"], ["", "", ""])
    assert out.components["shout_reward"].tolist() == [1.0, 0.0, 0.0]
    assert out.components["length_bonus"].tolist() == [2.5, 1.0, 0.5]
    assert out.total.tolist() == [1.0, 0.0, 0.0]  # weight 0: logged only
    assert out.success.tolist() == [True, False, False]


def test_kwargs_are_passed_through():
    KwargsRecorder.calls.clear()
    rewards = build_reward_set([{"_component_": _path(KwargsRecorder)}])
    rewards(
        ["a"], ["b"], questions=["q"], stopped=[True], response_lengths=[3], max_generated_tokens=8
    )
    assert KwargsRecorder.calls == [
        {"questions": ["q"], "stopped": [True], "response_lengths": [3], "max_generated_tokens": 8}
    ]


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([], "empty"),
        ([{"weight": 1.0}], r"rewards\[0\]: missing `_component_`"),
        ([{"_component_": CORRECT}, {"name": "x"}], r"rewards\[1\]: missing `_component_`"),
        ([{"_component_": "no_such_module.Reward"}], r"rewards\[0\].*'no_such_module.Reward'"),
        (
            [{"_component_": CORRECT}, {"_component_": "torchtune_grpo.rewards.components.Nope"}],
            r"rewards\[1\].*torchtune_grpo.rewards.components.Nope.*does not import",
        ),
        (
            [{"_component_": CORRECT, "success": True}, {"_component_": FORMAT, "success": True}],
            r"rewards\[1\]: `success: true` is also set on rewards\[0\]",
        ),
        (
            [{"_component_": CORRECT}, {"_component_": CORRECT, "answer_tag": None}],
            r"rewards\[1\]: `name` 'correctness' is already used by rewards\[0\]",
        ),
        ([{"_component_": CORRECT, "weight": "heavy"}], r"rewards\[0\].*`weight`"),
        ([{"_component_": CORRECT, "weight": float("inf")}], r"rewards\[0\].*`weight`.*finite"),
        ([{"_component_": CORRECT, "success": "yes"}], r"rewards\[0\].*`success`"),
        ([{"_component_": CORRECT, "on_error": "ignore"}], r"rewards\[0\].*`on_error`"),
        (
            [{"_component_": CORRECT}, {"_component_": FORMAT, "success_threshold": 0.5}],
            r"rewards\[1\]: `success_threshold`",
        ),
        ([{"_component_": CORRECT, "tag": "x"}], r"rewards\[0\].*could not construct.*tag"),
        ([{"_component_": "torchtune_grpo.rewards.reward_set.DEFAULT_SUCCESS_THRESHOLD"}],
         "callable"),
    ],
)
def test_build_errors(entries, match):
    with pytest.raises(ValueError, match=match):
        build_reward_set(_cfg(entries) if entries else entries)


def test_reward_entry_keys_are_checked_in_one_place():
    """build_reward_set, RewardSet and validate_config all go through check_reward_entry."""
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import ConfigError, validate_config
    from torchtune_grpo.rewards.reward_set import REWARD_ENTRY_KEYS, check_reward_entry

    assert REWARD_ENTRY_KEYS == {
        "_component_", "weight", "name", "success", "success_threshold", "on_error",
        "requires_success",
    }
    options, arguments = check_reward_entry(
        {"_component_": CORRECT, "weight": 2, "answer_tag": None}, "rewards[0]"
    )
    assert options == {"weight": 2.0, "name": None, "success": None,
                       "success_threshold": None, "on_error": "raise",
                       "requires_success": False}
    assert arguments == {"answer_tag": None}
    with pytest.raises(ValueError, match=r"rewards\[0\] \(a\): `weight` must be finite"):
        RewardSet([RewardEntry("a", FormatReward(), float("nan"))])
    with pytest.raises(ValueError, match=r"rewards\[0\] \(a\): `on_error`"):
        RewardSet([RewardEntry("a", FormatReward(), on_error="ignore")])

    cfg = load_config("grpo/quickstart_cpu")
    cfg.rewards[0].on_error = "ignore"
    cfg.rewards[0].name = "right"  # a reward-set key, not an argument of the component
    cfg.loss.weight = 1.0  # reward-set keys belong to reward entries only
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    message = str(info.value)
    assert f"rewards[0] ({CORRECT}): `on_error` must be 'raise' or 'zero'" in message
    assert "loss.weight" in message
    assert "rewards[0].name" not in message


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([1.0], r"'bad' returned 1 values for 2 completions"),
        (torch.zeros(2, 1), r"'bad' returned a tensor of shape \(2, 1\)"),
        ([1.0, "x"], r"'bad' returned a non-numeric value 'x' \(str\) for sample 1"),
        ("11", r"'bad' returned str"),
        (None, r"'bad' returned NoneType"),
        ([0.0, float("inf")], r"'bad' returned a non-finite value inf for sample 1"),
        (torch.tensor([float("nan"), 0.0]), r"non-finite value nan for sample 0"),
    ],
)
def test_output_validation(value, match):
    rewards = RewardSet([RewardEntry("bad", Returns(value))])
    with pytest.raises(ValueError, match=match):
        rewards(["first completion", "second completion"], ["1", "2"])


def test_non_finite_message_names_completion():
    rewards = build_reward_set([{"_component_": _path(NaNOnSecond)}])
    long_text = "y" * 1000
    with pytest.raises(ValueError, match=r"sample 1 \(completion 'yyy.*more chars\]'\)") as info:
        rewards(["x", long_text], ["1", "1"])
    assert len(str(info.value)) < 600  # the completion is truncated


def test_component_exception_names_component_and_sample():
    rewards = build_reward_set([{"_component_": _path(FailsOn), "name": "fragile"}])
    with pytest.raises(
        RuntimeError, match=r"'fragile' raised KeyError.*sample 2.*'a boom'"
    ) as info:
        rewards(["fine", "ok", "a boom", "boom again"], ["1"] * 4)
    assert isinstance(info.value.__cause__, KeyError)


def test_on_error_zero_counts_errors():
    rewards = build_reward_set(
        [
            {"_component_": _path(FailsOn), "name": "fragile", "on_error": "zero"},
            {"_component_": FORMAT, "weight": 0.0},
        ]
    )
    out = rewards(["fine", "boom", "ok", "boom!"], ["1"] * 4, stopped=[True] * 4)
    assert out.components["fragile"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.errors == {"fragile": 2, "format": 0}
    assert out.success.tolist() == [True, False, True, False]


class _Counting:
    """Scores 1 per sample, counts the samples containing "odd" and raises on "boom"."""

    def __init__(self):
        self.last_counts = {}

    def __call__(self, completions, answers, **kwargs):
        self.last_counts = {"odd": sum("odd" in c for c in completions)}
        if any("boom" in c for c in completions):
            raise ValueError("boom")
        return [1.0] * len(completions)


def test_component_counters_are_summed_into_the_output():
    counting = _Counting()
    rewards = RewardSet([RewardEntry("correct", NumericCorrectness()),
                         RewardEntry("c", counting, on_error="zero")])
    out = rewards(["odd", "even", "odd odd"], ["1"] * 3)
    assert out.counts == {"c/odd": 2}
    # after a failed batch call, each sample alone (the failed batch call is not counted)
    out = rewards(["odd", "boom odd", "x", "odd"], ["1"] * 4)
    assert out.components["c"].tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out.errors["c"] == 1 and out.counts == {"c/odd": 3}
    # components without counters add none
    plain = RewardSet([RewardEntry("correct", NumericCorrectness())])
    assert plain(["1"], ["1"]).counts == {}


def test_component_counters_must_be_integers():
    bad = type("Bad", (), {"last_counts": {"odd": 1.5},
                           "__call__": lambda self, c, a, **k: [1.0] * len(c)})()
    with pytest.raises(TypeError, match="last_counts.*integers"):
        RewardSet([RewardEntry("b", bad)])(["x"], ["1"])


def test_reward_set_length_mismatch_and_empty_batch():
    rewards = build_reward_set([{"_component_": CORRECT}])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        rewards(["a", "b"], ["1"])
    out = rewards([], [])
    assert out.total.shape == (0,) and out.success.shape == (0,)


def test_reward_set_direct_construction():
    rewards = RewardSet(
        [RewardEntry("a", FormatReward(), 1.0), RewardEntry("b", NumericCorrectness(), 0.5)],
        success_name="b",
    )
    assert rewards.success_name == "b"
    with pytest.raises(ValueError, match="duplicate"):
        RewardSet([RewardEntry("a", FormatReward()), RewardEntry("a", FormatReward())])
    with pytest.raises(ValueError, match="at least one"):
        RewardSet([])


def test_overlong_penalty_hand_values():
    from torchtune_grpo.rewards.components import OverlongPenalty

    pen = OverlongPenalty(cache_tokens=4)
    # L = 10: no penalty up to 6 tokens, then -(n - 6) / 4, -1 beyond 10
    got = pen(["x"] * 5, ["1"] * 5, response_lengths=[3, 6, 7, 10, 11], max_generated_tokens=10)
    assert got == [0.0, 0.0, -0.25, -1.0, -1.0]
    assert OverlongPenalty(2, max_tokens=4)(["x"], ["1"], response_lengths=[3]) == [-0.5]
    with pytest.raises(ValueError, match="response_lengths"):
        pen(["x"], ["1"])
    with pytest.raises(ValueError, match="cache_tokens"):
        OverlongPenalty(0)


# ---------------------------------------------------------------- plain-text answer phrase
def test_answer_phrase_correctness():
    from torchtune_grpo.rewards.components import NumericCorrectness

    fn = NumericCorrectness(answer_tag=None, answer_phrase="The answer is")
    completions = [
        "16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\nThe answer is 18.",   # phrase, right
        "The answer is $18.00 per day",                         # currency and decimals
        "I think 18.\nThe answer is 20.",                       # phrase wins over earlier 18
        "so she makes 18 dollars",                              # no phrase: fallback none
        "The answer is 1,018.\nBy the way 18",                  # the phrase's line only
    ]
    assert fn(completions, ["18"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    lenient = NumericCorrectness(answer_tag=None, answer_phrase="the answer is",
                                 fallback="last_number")
    assert lenient(["so she makes 18 dollars"], ["18"]) == [1.0]
    with pytest.raises(ValueError, match="either answer_tag or answer_phrase"):
        NumericCorrectness(answer_phrase="The answer is")  # answer_tag defaults to "answer"


def test_answer_phrase_format():
    from torchtune_grpo.rewards.components import AnswerPhraseFormat

    fn = AnswerPhraseFormat("The answer is")
    completions = ["Steps.\nThe answer is 7.", "The answer is 7.\nMore text after it.",
                   "Steps.\nthe answer is 7", "The answer is seven.", "no answer"]
    assert fn(completions, [""] * 5, stopped=[True] * 5) == [1.0, 0.5, 1.0, 0.0, 0.0]
    # cut off at the token limit: never full credit
    assert fn(completions[:1], [""], stopped=[False]) == [0.5]
    with pytest.raises(ValueError, match="non-empty"):
        AnswerPhraseFormat("  ")
