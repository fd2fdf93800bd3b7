"""The tool quickstart's task (multiplication) and its warm-up demonstrations."""

from __future__ import annotations

import random

import pytest
import torch

from torchtune_grpo.datasets import (
    MULTIPLICATION_ANSWER_PHRASE,
    multiplication_dataset,
    multiplication_problems,
)
from torchtune_grpo.datasets.multiplication import MULTIPLICATION_SPLIT_SIZES
from torchtune_grpo.quickstart.prepare import QUICKSTART_MODEL_DIMS
from torchtune_grpo.quickstart.tiny import tiny_llama, tiny_tokenizer
from torchtune_grpo.quickstart.tools import (
    copy_drills,
    direct_guess,
    tool_demonstration,
    tool_rollout,
    tool_warmup,
)
from torchtune_grpo.rewards.components import NumericCorrectness
from torchtune_grpo.rollout.tools.calculator import Calculator
from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax


def test_splits_are_disjoint_fixed_and_cover_every_pair():
    splits = {s: multiplication_problems(s) for s in ("train", "test", "warmup")}
    assert {s: len(p) for s, p in splits.items()} == {
        "test": MULTIPLICATION_SPLIT_SIZES["test"],
        "warmup": MULTIPLICATION_SPLIT_SIZES["warmup"], "train": 90 * 900 - 5300}
    questions = [set(q for q, _ in p) for p in splits.values()]
    assert sum(map(len, questions)) == len(set().union(*questions)) == 90 * 900
    assert multiplication_problems("test") == splits["test"]  # fixed order
    for question, answer in splits["test"]:
        a, b = question.removeprefix("What is ").removesuffix("?").split("*")
        assert 10 <= int(a) <= 99 and 100 <= int(b) <= 999
        assert int(answer) == int(a) * int(b)
    with pytest.raises(ValueError, match="split must be .train., .test. or .warmup., got .dev."):
        multiplication_problems("dev")


def test_dataset_prompts_are_plain_text_after_bos(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)
    ds = multiplication_dataset(tokenizer, split="test", limit=3)
    assert len(ds) == 3
    question, answer = multiplication_problems("test")[0]
    row = ds[0]
    assert row["answer"] == answer
    assert row["tokens"] == tokenizer.encode(question, add_bos=True, add_eos=False)


def test_demonstrations_score_as_the_reward_reads_them():
    """A tool demonstration's final answer is right; a direct one is a wrong guess; the tool's
    result alone (no final answer) earns nothing."""
    reward = NumericCorrectness(answer_tag=None, answer_phrase=MULTIPLICATION_ANSWER_PHRASE)
    rng = random.Random(0)
    question, answer = "What is 37*412?", "15244"
    tool = tool_demonstration(question, answer, use_tool=True, rng=rng)
    assert [t for t, _ in tool] == ["<calculator>37*412</calculator>", "<result>15244</result>",
                                    "Answer: 15244"]
    assert [trained for _, trained in tool] == [True, False, True]  # the result is context
    call = ToolCallSyntax().last_call(tool[0][0], ["calculator"])
    assert Calculator()(call.arguments) == answer
    direct = tool_demonstration(question, answer, use_tool=False, rng=rng)
    assert len(direct) == 1 and direct[0][1]
    texts = ["".join(t for t, _ in tool), direct[0][0], tool[0][0] + tool[1][0]]
    assert reward(texts, [answer] * 3) == [1.0, 0.0, 0.0]


def test_direct_guess_is_plausible_and_never_right():
    rng = random.Random(0)
    for _, answer in multiplication_problems("warmup")[:500]:
        guess = int(direct_guess(answer, rng))
        assert guess != int(answer)
        assert 0.79 * int(answer) <= guess <= 1.21 * int(answer)


def test_tool_warmup_is_deterministic_and_trains_only_model_text(tmp_path, monkeypatch):
    """Same seed, same weights; the loss never covers the tool's result tokens."""
    import torchtune_grpo.quickstart.tools as qs

    tokenizer = tiny_tokenizer(tmp_path)
    problems = multiplication_problems("warmup")[:50]
    weights = []
    seen = []
    original = qs.train_on_demonstrations

    def spy(model, tok, demonstrate, **kwargs):
        def wrapped():
            prompt, segments = demonstrate()
            seen.append(segments)
            return prompt, segments
        return original(model, tok, wrapped, **kwargs)

    monkeypatch.setattr(qs, "train_on_demonstrations", spy)  # where tool_warmup looks it up
    for _ in range(2):
        torch.manual_seed(0)
        model = tiny_llama(**QUICKSTART_MODEL_DIMS)
        tool_warmup(model, tokenizer, problems, steps=2, batch_size=8, tool_fraction=0.5, seed=3)
        weights.append(model.state_dict())
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    result_open = tokenizer.encode("<result>", add_bos=False, add_eos=False)
    with_tool = [s for s in seen if any(w == 0 for _, w in s)]
    assert with_tool and len(with_tool) < len(seen)  # both kinds of demonstration
    for segments in with_tool:  # first token, rest of the call, result, answer, end of turn
        assert [w for _, w in segments] == [1.0, 3.0, 0.0, 3.0, 3.0]  # tool_weight default 3
        ids, _ = segments[2]
        assert ids[: len(result_open)] == result_open
    for segments in seen:
        assert segments[0][1] == 1.0 and len(segments[0][0]) == 1  # the choice: weight 1
        assert segments[-1][0] == [tokenizer.eot_id]
    for segments in (s for s in seen if s not in with_tool):
        assert [w for _, w in segments] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="tool_fraction"):
        tool_warmup(model, tokenizer, problems, steps=1, tool_fraction=1.5)


def test_copy_drills_never_train_the_choice_to_call(tmp_path):
    """Result -> answer drills copy a random number after BOS alone; operands -> call drills
    leave the call's first token (the choice) untrained; none trains a tool's result."""
    tokenizer = tiny_tokenizer(tmp_path)
    problems = multiplication_problems("warmup")[:50]
    drills = copy_drills(tokenizer, problems, random.Random(0), answer_drills=5, call_drills=3)
    assert len(drills) == 8
    reward = NumericCorrectness(answer_tag=None, answer_phrase=MULTIPLICATION_ANSWER_PHRASE)
    for prompt, segments in drills[:5]:
        assert prompt == [tokenizer.bos_id]
        (result, w_result), (answer, w_answer) = segments
        assert (w_result, w_answer) == (0.0, 1.0) and answer[-1] == tokenizer.eot_id
        number = tokenizer.decode(result).removeprefix("<result>").removesuffix("</result>")
        assert tokenizer.decode(answer[:-1]) == f"Answer: {number}" and 4 <= len(number) <= 5
        assert reward([tokenizer.decode(answer[:-1])], [number]) == [1.0]
    questions = {q for q, _ in problems}
    for prompt, segments in drills[5:]:
        question = tokenizer.decode(prompt[1:])
        assert question in questions
        (first, w_first), (rest, w_rest) = segments
        assert (len(first), w_first, w_rest) == (1, 0.0, 1.0)
        assert tokenizer.decode(first + rest) == (
            f"<calculator>{question.removeprefix('What is ').removesuffix('?')}</calculator>")


def test_tool_rollout_returns_a_text_and_a_call_rate_per_question(tmp_path):
    """Greedy multi-turn rollout on random weights (no call): texts and a zero call rate."""
    tokenizer = tiny_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = tiny_llama(**QUICKSTART_MODEL_DIMS)
    questions = [q for q, _ in multiplication_problems("test")[:3]]
    for tools in (True, False):
        texts, calls = tool_rollout(model, tokenizer, questions, tools=tools, max_new=8)
        assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
        assert calls == 0.0
