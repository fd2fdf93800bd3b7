"""Learned rewards (``torchtune_grpo.rewards.learned``) on tiny models whose scores are known.

The reward model is a random ``transformers`` sequence classifier (the reference): our scores
must equal its scores on the same rendered ids. The judge is a causal Llama built so that its
greedy reply to any prompt is "7" (``tests/unit/rewards/_learned_models.py``), so its score is
known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.unit.rewards._learned_models import (  # noqa: E402
    RM_CASES,
    with_local_reward_models,
    write_judge,
    write_reward_model,
)
from torchtune_grpo.rewards import GenerativeJudge, RewardModelScore  # noqa: E402
from torchtune_grpo.rewards.build import build_reward_set  # noqa: E402
from torchtune_grpo.rewards.learned.inputs import last_position_scores, template_fields  # noqa: E402
from torchtune_grpo.rewards.learned.judge_parsers import (  # noqa: E402
    make_parser,
    reply_first_number,
    reply_last_number,
    reply_yes_no,
)

QUESTIONS = ["What is 12 + 30?", "Natalia sold clips to 48 of her friends in April.",
             "What is 12 + 30?", "Why?", "What is 12 + 30?"]
COMPLETIONS = ["The answer is 42.", "42",
               "Natalia sold clips to 48 of her friends in April, and then she sold half as "
               "many. The answer is 72.", "", "line one\nline two\n\n  indented 0123456789"]
ANSWERS = ["42", "72", "42", "1", "42"]


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory):
    """``{case: (folder, transformers reference)}`` for every reward-model case."""
    root = tmp_path_factory.mktemp("reward_models")
    return {case: (root / case, write_reward_model(root / case, case)) for case in RM_CASES}


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge") / "judge"
    write_judge(folder, reply="7")
    return folder


def _reference_scores(ref, rm: RewardModelScore) -> list[float]:
    """transformers' score of each (question, completion) alone, on our rendered ids."""
    # the fast tokenizer of tokenizer.json itself (AutoTokenizer would pick a model-specific
    # class from config.json, e.g. Qwen2Tokenizer with its own pre-tokenizer)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(rm.model_dir))
    scores = []
    for question, completion in zip(QUESTIONS, COMPLETIONS, strict=True):
        ids = rm.encode(question, completion)
        conversation = [{"role": "user", "content": question},
                        {"role": "assistant", "content": completion}]
        hf_ids = tok.apply_chat_template(conversation, tokenize=True)
        hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
        assert ids == [int(i) for i in hf_ids]  # the same rendering as transformers
        with torch.no_grad():
            scores.append(float(ref(torch.tensor([ids])).logits[0, 0]))
    return scores


# ---------------------------------------------------------------------------- reward model
@pytest.mark.parametrize("case", sorted(RM_CASES))
def test_reward_model_scores_equal_transformers(reward_models, case):
    folder, ref = reward_models[case]
    want = _reference_scores(ref, RewardModelScore(str(folder)))
    assert max(want) - min(want) > 0.5  # the completions score differently: not degenerate
    one_batch = RewardModelScore(str(folder), batch_size=8)(COMPLETIONS, ANSWERS,
                                                             questions=QUESTIONS)
    batched = RewardModelScore(str(folder), batch_size=2)(COMPLETIONS, ANSWERS,
                                                          questions=QUESTIONS)
    torch.testing.assert_close(torch.tensor(one_batch), torch.tensor(want), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(one_batch), atol=1e-5,
                               rtol=0)


def test_reward_model_is_frozen_and_deterministic(reward_models):
    folder, _ = reward_models["llama"]
    rm = RewardModelScore(str(folder), normalize="sigmoid")
    assert not rm.model.training
    assert all(not p.requires_grad for p in rm.model.parameters())
    first = rm(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    assert rm(COMPLETIONS, ANSWERS, questions=QUESTIONS) == first
    assert all(0.0 < s < 1.0 for s in first)  # sigmoid
    assert all(not p.requires_grad and p.grad is None for p in rm.model.parameters())


def test_reward_model_truncates_from_the_left_or_names_the_sample(reward_models):
    folder, ref = reward_models["llama"]
    rm = RewardModelScore(str(folder), max_seq_len=24)
    lengths = [len(rm.encode(q, c)) for q, c in zip(QUESTIONS, COMPLETIONS, strict=True)]
    assert max(lengths) > 24 and min(lengths) <= 24
    got = rm(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    assert rm.last_truncated == sum(n > 24 for n in lengths)
    for i, (q, c) in enumerate(zip(QUESTIONS, COMPLETIONS, strict=True)):
        with torch.no_grad():
            want = float(ref(torch.tensor([rm.encode(q, c)[-24:]])).logits[0, 0])
        assert got[i] == pytest.approx(want, abs=1e-4)
    strict = RewardModelScore(str(folder), max_seq_len=24, truncation="error")
    first_long = next(i for i, n in enumerate(lengths) if n > 24)
    with pytest.raises(ValueError, match=f"sample {first_long} has {lengths[first_long]} tokens"):
        strict(COMPLETIONS, ANSWERS, questions=QUESTIONS)


def test_last_position_scores_reads_each_sequence_at_its_own_end():
    scores = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert last_position_scores(scores, torch.tensor([4, 1, 2])).tolist() == [3.0, 4.0, 9.0]


def test_reward_model_refuses_what_it_cannot_score(reward_models, tmp_path):
    folder, _ = reward_models["llama"]
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "two_labels"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(
        {**cfg, "id2label": {"0": "bad", "1": "good"}, "label2id": {"bad": 0, "good": 1}}))
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model must output one score") \
            as info:
        RewardModelScore(str(bad))
    assert str(bad) in str(info.value)
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification") as info:
        RewardModelScore(str(bad))
    assert "not a supported reward model" in str(info.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RewardModelScore(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="needs the `questions`"):
        RewardModelScore(str(folder))(["a"], ["1"])
    with pytest.raises(ValueError, match="truncation must be"):
        RewardModelScore(str(folder), truncation="right")


# ---------------------------------------------------------------------------- judge
TEMPLATE = "Problem: {question}\nReference: {answer}\nSolution: {completion}\nScore 0-10:"


def test_judge_scores_its_known_reply(judge_dir):
    judge = GenerativeJudge(str(judge_dir), TEMPLATE, batch_size=2)
    assert judge(COMPLETIONS, ANSWERS, questions=QUESTIONS) == [7.0] * 5
    assert judge.last_replies == ["7"] * 5 and judge.last_parse_failures == 0
    assert all(not p.requires_grad for p in judge.model.parameters())
    scaled = GenerativeJudge(str(judge_dir), TEMPLATE, score_range=[0, 10], batch_size=8)
    assert scaled(COMPLETIONS, ANSWERS, questions=QUESTIONS) == pytest.approx([0.7] * 5)
    # a template without {question} needs no questions
    assert GenerativeJudge(str(judge_dir), "Grade: {completion}")(["x"], ["1"]) == [7.0]


def test_judge_prompt_is_the_filled_template_in_the_judges_chat_template(judge_dir):
    judge = GenerativeJudge(str(judge_dir), TEMPLATE, system_prompt="Be strict.")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(judge_dir))
    for q, c, a in zip(QUESTIONS, COMPLETIONS, ANSWERS, strict=True):
        messages = [{"role": "system", "content": "Be strict."},
                    {"role": "user", "content": f"Problem: {q}\nReference: {a}\n"
                                                f"Solution: {c}\nScore 0-10:"}]
        want = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert judge.prompt_ids(q, c, a) == [int(i) for i in want]


def test_judge_parse_failures_are_scored_or_named(judge_dir):
    lenient = GenerativeJudge(str(judge_dir), TEMPLATE, parser="yes_no", on_parse_failure=0.0)
    assert lenient(COMPLETIONS, ANSWERS, questions=QUESTIONS) == [0.0] * 5
    assert lenient.last_parse_failures == 5 and lenient.parse_failures == 5
    strict = GenerativeJudge(str(judge_dir), TEMPLATE, parser="yes_no")
    with pytest.raises(ValueError, match=r"reply to sample 0 of this batch .*'yes_no'.*: '7'"):
        strict(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    out_of_range = GenerativeJudge(str(judge_dir), TEMPLATE, score_range=[0, 5],
                                   on_parse_failure=-1.0)
    assert out_of_range(COMPLETIONS[:2], ANSWERS[:2], questions=QUESTIONS[:2]) == [-1.0, -1.0]


def test_learned_counters_report_each_call(reward_models, judge_dir):
    """``last_counts`` describes the last call only, also after a call that raised."""
    folder, _ = reward_models["llama"]
    rm = RewardModelScore(str(folder), max_seq_len=24)
    short = [i for i, (q, c) in enumerate(zip(QUESTIONS, COMPLETIONS, strict=True))
             if len(rm.encode(q, c)) <= 24]
    rm(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    assert rm.last_counts == {"truncated": len(COMPLETIONS) - len(short)} != {"truncated": 0}
    rm([COMPLETIONS[short[0]]], [ANSWERS[0]], questions=[QUESTIONS[short[0]]])
    assert rm.last_counts == {"truncated": 0}
    rm(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    rm.truncation = "error"  # a call that raises leaves no stale count behind
    with pytest.raises(ValueError):
        rm(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    assert rm.last_counts == {"truncated": 0}
    judge = GenerativeJudge(str(judge_dir), TEMPLATE, parser="yes_no", on_parse_failure=0.0)
    judge(COMPLETIONS[:3], ANSWERS[:3], questions=QUESTIONS[:3])
    assert judge.last_counts == {"parse_failures": 3}
    rewards = build_reward_set([
        {"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
         "answer_tag": None, "success": True},
        {"_component_": "torchtune_grpo.rewards.GenerativeJudge", "model_dir": str(judge_dir),
         "prompt_template": TEMPLATE, "parser": "yes_no", "on_parse_failure": 0.0}])
    out = rewards(COMPLETIONS, ANSWERS, questions=QUESTIONS)
    assert out.counts == {"judge/parse_failures": 5}


def test_judge_arguments_fail_at_construction(judge_dir, tmp_path):
    with pytest.raises(ValueError, match=r"unknown field \{rubric\}"):
        GenerativeJudge(str(tmp_path / "absent"), "Grade {completion} by {rubric}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GenerativeJudge(str(tmp_path / "absent"), TEMPLATE)
    with pytest.raises(ValueError, match="unknown parser 'score'"):
        GenerativeJudge(str(judge_dir), TEMPLATE, parser="score")
    with pytest.raises(ValueError, match="on_parse_failure must be 'error' or a finite number"):
        GenerativeJudge(str(judge_dir), TEMPLATE, on_parse_failure="zero")
    with pytest.raises(ValueError, match="score_range must be"):
        GenerativeJudge(str(judge_dir), TEMPLATE, score_range=[10, 0])
    with pytest.raises(ValueError, match="positional field"):
        GenerativeJudge(str(judge_dir), "Grade {}")
    short = GenerativeJudge(str(judge_dir), TEMPLATE, max_seq_len=20, max_generated_tokens=4)
    with pytest.raises(ValueError, match="judge prompt of sample 0 has .* more than"):
        short(COMPLETIONS, ANSWERS, questions=QUESTIONS)


@pytest.mark.parametrize("reply, number, last, yn", [
    ("7", 7.0, 7.0, None),
    ("Score: 8/10", 8.0, 10.0, None),
    ("7.5 out of 10. Yes.", 7.5, 10.0, 1.0),
    ("-2, then +3", -2.0, 3.0, None),
    ("NO. It is wrong; v2 of it scores .5", 0.5, 0.5, 0.0),
    ("Nobody knows; yes it is", None, None, 1.0),
    ("", None, None, None),
])
def test_parsers_on_fixed_replies(reply, number, last, yn):
    assert reply_first_number(reply) == number
    assert reply_last_number(reply) == last
    assert reply_yes_no(reply) == yn
    assert make_parser("number")(reply) == number


def test_regex_parser_takes_the_first_match_and_its_group():
    parse = make_parser(r"regex:Score:\s*(\d+(?:\.\d+)?)")
    assert parse("Score: 3 ... Score: 9") == 3.0
    assert parse("no score here") is None
    assert make_parser(r"regex:\d+")("a 12 b 13") == 12.0
    assert make_parser(r"regex:(grade [A-F])")("grade B") is None  # not a number
    with pytest.raises(ValueError, match="does not compile"):
        make_parser("regex:(")
    assert template_fields("{question} {{literal}} {completion!r:>5}") == {"question",
                                                                            "completion"}


# ---------------------------------------------------------------------------- config
def test_reward_entries_build_and_score_a_batch(reward_models, judge_dir):
    folder, ref = reward_models["llama"]
    rewards = build_reward_set([
        {"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
         "answer_tag": None, "success": True},
        {"_component_": "torchtune_grpo.rewards.RewardModelScore", "model_dir": str(folder),
         "batch_size": 2, "weight": 0.5},
        {"_component_": "torchtune_grpo.rewards.GenerativeJudge", "model_dir": str(judge_dir),
         "prompt_template": TEMPLATE, "score_range": [0, 10], "weight": 0.1,
         "requires_success": True},
    ])
    assert rewards.names == ["correctness", "reward_model", "judge"]
    out = rewards(COMPLETIONS, ANSWERS, questions=QUESTIONS, stopped=[True] * 5)
    rm_scores = out.components["reward_model"]
    torch.testing.assert_close(rm_scores, torch.tensor(_reference_scores(
        ref, rewards.entries[1].fn)), atol=1e-4, rtol=0)
    assert out.components["judge"].tolist() == pytest.approx([0.7] * 5)
    # their counters reach the output (logged as reward/<name>/<counter>)
    assert out.counts == {"reward_model/truncated": 0, "judge/parse_failures": 0}
    want = out.components["correctness"] + 0.5 * rm_scores + 0.07 * out.success.float()
    torch.testing.assert_close(out.total, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["grpo/learned_reward_example", "grpo/judge_reward_example"])
def test_example_configs_build_with_local_folders(name, tmp_path):
    from torchtune_grpo.config.loading import load_config
    from torchtune_grpo.config.validation import validate_config

    cfg = load_config(name)
    validate_config(cfg)  # as shipped, with folders that are not on this machine
    rewards = build_reward_set(with_local_reward_models(cfg, tmp_path).rewards)
    out = rewards(COMPLETIONS, ANSWERS, questions=QUESTIONS, stopped=[True] * 5)
    assert out.total.shape == (5,) and torch.isfinite(out.total).all()
    learned = [n for n in rewards.names if n in ("reward_model", "judge")]
    assert learned and all(torch.isfinite(out.components[n]).all() for n in learned)


# ---------------------------------------------------------------------------- memory
@pytest.mark.parametrize("name", ["grpo/learned_reward_example", "grpo/judge_reward_example"])
def test_memory_estimate_counts_the_learned_reward_models(name, tmp_path):
    """``estimate-memory`` sizes a learned reward's frozen model from its folder: exactly the
    parameters the component builds, resident on the policy's device (or listed apart when it
    sits elsewhere), plus a scoring phase; an unreadable folder is named, not guessed."""
    from torchtune_grpo.cli.memory_estimate import estimate_memory
    from torchtune_grpo.config.loading import load_config

    shipped = load_config(name)
    before = estimate_memory(shipped)  # the example's folder is not on this machine
    assert before.components["reward_models"] == 0 and "rewards" not in before.phases
    assert len(before.settings["not_counted"]) == 1
    assert "does not exist" in before.settings["not_counted"][0]

    cfg = with_local_reward_models(load_config(name), tmp_path)
    rewards = build_reward_set(cfg.rewards)
    learned = [e for e in rewards.entries if e.name in ("reward_model", "judge")]
    assert len(learned) == 1
    built = sum(p.numel() for p in learned[0].fn.model.parameters())  # what it really holds
    cfg.device = "cpu"  # the policy's device, where the entry sits (with_local_reward_models)
    est = estimate_memory(cfg)
    [entry] = est.settings["learned_rewards"]
    assert entry["params"] == built and entry["weights"] == 4 * built  # fp32
    assert est.components["reward_models"] == 4 * built
    assert est.settings["not_counted"] == []
    static = sum(est.components[k] for k in ("weights", "optimizer_state", "reference_model",
                                             "reward_models"))
    assert est.phases["rewards"] >= static + entry["scoring"] > static
    # one scoring batch, by hand from config.json: the forward's working set, and for the
    # judge its KV cache for batch_size prompts of max_seq_len plus the sampling buffers
    fn = learned[0].fn
    hf = json.loads((Path(fn.model_dir) / "config.json").read_text())
    rows = fn.batch_size * fn.max_seq_len
    want = rows * (4 * hf["hidden_size"] + 3 * hf["intermediate_size"]) * 4
    if entry["name"] == "judge":
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
        want += rows * hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_dim * 4
        want += fn.batch_size * hf["vocab_size"] * 16
    assert entry["scoring"] == want
    on_cpu = estimate_memory(load_config(name, ["device=cpu"]))  # the folder still unread
    assert est.phases["update"] == on_cpu.phases["update"] + 4 * built  # now static state
    assert est.other_devices == {}
    assert "reward_models" in est.table()

    cfg.device = "cuda"  # the policy elsewhere: the reward model is listed apart
    apart = estimate_memory(cfg)
    assert apart.components["reward_models"] == 0 and "rewards" not in apart.phases
    assert apart.other_devices == {"cpu": entry["weights"] + entry["scoring"]}
    assert "rewards on cpu" in apart.table()
