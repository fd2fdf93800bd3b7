"""Multi-turn rollouts with tools: results appended as tool tokens, masked from the loss.

A scripted engine (``_tool_components.ScriptedGenerator``) pins the token layout exactly; the
native engine on the tiny model (random, and overfitted to a transcript with a calculator call)
checks the real sampler, seeds, lockstep and log-probs; the masking tests run ``GRPOLoss`` on
``micro_batch_logprobs`` of a 2-turn rollout.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from _tool_components import ScriptedGenerator

from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories, pad_trajectory
from torchtune_grpo.policy.forward import micro_batch_logprobs
from torchtune_grpo.policy.positions import trim_to_extent
from torchtune_grpo.quickstart.tiny import tiny_llama
from torchtune_grpo.rollout.multiturn import ToolUseGenerator, global_max
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import GenerationRequest
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.rollout.tool_trajectory import ToolStats, decode_with_tools, tool_segments
from torchtune_grpo.rollout.tools.calculator import Calculator
from torchtune_grpo.token_rules import allowed_token_mask, logit_bias_from_mask, stop_token_ids

SCRIPTS = {
    "A:": "x<calculator>2*3</calculator>y.",  # one call
    "B:": "no tools.",  # none
    "C:": "<calculator>1+1</calculator><calculator>1/0</calculator><calculator>3</calculator>z",
    "D:": "a much longer preamble here<calculator>7</calculator>!",  # for the position cap
}
KEYS = ("A:", "B:", "C:")
RESULTS = {"A:": ["<result>6</result>"], "B:": [],
           "C:": ["<result>2</result>", "<result>error: division by zero</result>",
                  "<result>3</result>"],
           "D:": ["<result>7</result>"]}


def _left_pad(prompts, pad_id):
    width = max(map(len, prompts))
    tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return tokens, mask


def _prompts(tokenizer, keys):
    return _left_pad([tokenizer.encode(k, add_bos=True, add_eos=False) for k in keys],
                     tokenizer.pad_id)


def _scripted(tokenizer, keys=KEYS, *, group_size=2, max_generated_tokens=200,
              max_tool_calls=2, forward_batch_size=4, all_done=None, prompt_seeds=None,
              logit_bias=None, model=None):
    inner = ScriptedGenerator(tokenizer, SCRIPTS, tokenizer.eot_id)
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer, inner=inner,
                           max_tool_calls=max_tool_calls)
    tokens, mask = _prompts(tokenizer, keys)
    traj = gen.generate(model, GenerationRequest(tokens, mask, group_size=group_size,
        max_generated_tokens=max_generated_tokens,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        temperature=1.0, top_k=None, logit_bias=logit_bias, forward_batch_size=forward_batch_size,
        prompt_seeds=prompt_seeds, all_done=all_done))
    return traj, gen, inner


def _expected(key, max_tool_calls=2):
    """The full transcript of a script: the model's text with the results spliced in."""
    text, out = SCRIPTS[key], ""
    results = RESULTS[key][:max_tool_calls]
    while "</calculator>" in text:
        head, text = text.split("</calculator>", 1)
        out += head + "</calculator>"
        if results:
            out += results.pop(0)
    return out + text


# ---------------------------------------------------------------------------- Trajectory
def _traj_with_tools():
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    return Trajectory(
        tokens=torch.arange(2 * 9).reshape(2, 9), prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]],
                                                                             dtype=torch.bool),
        response_mask=response_mask, logprobs=-torch.rand(2, 6) * response_mask,
        stopped=torch.tensor([True, False]), pad_id=0, tool_mask=tool_mask)


def test_tool_mask_defaults_to_false_and_travels_through_helpers():
    traj = _traj_with_tools()
    plain = Trajectory(tokens=traj.tokens, prompt_mask=traj.prompt_mask,
                       response_mask=traj.response_mask, logprobs=traj.logprobs,
                       stopped=traj.stopped, pad_id=0)
    assert plain.tool_mask.shape == (2, 6) and not plain.tool_mask.any()
    assert torch.equal(plain.padding_mask, torch.cat([plain.prompt_mask, plain.response_mask], 1))
    # present tokens: prompt | policy | tool; lengths count the policy's tokens only
    assert torch.equal(traj.padding_mask[0], torch.tensor([0, 1, 1] + [1] * 6, dtype=torch.bool))
    assert traj.response_lengths.tolist() == [4, 3] and traj.tool_lengths.tolist() == [2, 0]
    assert torch.equal(traj.select(torch.tensor([1, 0])).tool_mask, traj.tool_mask.flip(0))
    assert torch.equal(traj.to("cpu").tool_mask, traj.tool_mask)
    padded = pad_trajectory(traj, 5, 9)
    assert padded.tool_mask.shape == (2, 9) and torch.equal(padded.tool_mask[:, :6],
                                                            traj.tool_mask)
    both = concat_trajectories([plain, padded])
    assert both.tool_mask.shape == (4, 9) and torch.equal(both.tool_mask[2:], padded.tool_mask)
    assert not both.tool_mask[:2].any()
    with pytest.raises(ValueError, match="tool_mask"):
        Trajectory(tokens=traj.tokens, prompt_mask=traj.prompt_mask,
                   response_mask=traj.response_mask, logprobs=traj.logprobs,
                   stopped=traj.stopped, pad_id=0, tool_mask=torch.zeros(2, 5, dtype=torch.bool))


def test_trim_keeps_tool_tokens_as_real_tokens():
    traj = _traj_with_tools()
    # a row ending in tool tokens (a result cut by the budget): they are kept and attended
    response_mask = torch.tensor([[1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    trimmed = trim_to_extent(traj.tokens[:1], traj.prompt_mask[:1], response_mask, tool_mask)
    assert trimmed.response_len == 4 and trimmed.prompt_len == 2
    assert trimmed.padding_mask.tolist() == [[True] * 6]
    assert trim_to_extent(traj.tokens[:1], traj.prompt_mask[:1], response_mask).response_len == 2


# ---------------------------------------------------------------------------- scripted turns
def test_results_are_appended_as_tool_tokens_and_only_they_are_masked(tokenizer):
    traj, gen, inner = _scripted(tokenizer)
    stops = stop_token_ids(tokenizer)
    keys = [k for k in KEYS for _ in range(2)]
    assert decode_with_tools(tokenizer, traj, stops) == [_expected(k) for k in keys]
    n, width = traj.response_mask.shape
    assert traj.tokens.shape == (n, traj.prompt_len + width) and n == 6
    assert not (traj.response_mask & traj.tool_mask).any()
    for row, key in enumerate(keys):
        text = _expected(key)  # byte-level tokenizer: one token per character
        tool = torch.zeros(width, dtype=torch.bool)
        for result in RESULTS[key][:2]:
            start = text.index(result)
            tool[start : start + len(result)] = True
        assert torch.equal(traj.tool_mask[row], tool), key
        present = torch.zeros(width, dtype=torch.bool)
        present[: len(text) + 1] = True  # + the stop token
        assert torch.equal(traj.response_mask[row], present & ~tool), key
        assert (traj.response_tokens[row][~present] == tokenizer.pad_id).all()
        assert traj.response_tokens[row, len(text)] == tokenizer.eot_id
        # the policy's log-probs are the engine's (script character c: -(c + 1) / 100); 0 on tools
        assert (traj.logprobs[row][tool] == 0).all() and (traj.logprobs[row][~present] == 0).all()
        expected = torch.tensor([-(c + 1) / 100 for c in range(len(SCRIPTS[key]) + 1)])
        assert torch.allclose(traj.logprobs[row][present & ~tool], expected), key
    assert traj.stopped.all()
    stats = gen.pop_stats()
    assert (stats.completions, stats.calls, stats.errors) == (6, 6, 2)
    assert stats.result_tokens == int(traj.tool_mask.sum())
    assert ToolStats.metrics(stats)["tools/calls_per_completion"] == 1.0
    assert gen.pop_stats() == ToolStats()
    segments = tool_segments(tokenizer, traj, stops)[0]
    assert [s["source"] for s in segments] == ["model", "tool", "model"]
    assert segments[1]["text"] == "<result>6</result>"


def test_rows_in_different_turns_share_one_padded_batch(tokenizer):
    traj, _, inner = _scripted(tokenizer)
    # turn 0: all 6 rows; then only the rows still pending (A and C), then C alone
    assert [c["rows"] for c in inner.calls] == [6, 4, 4, 2, 2]
    # each row is what it would be on its own, whatever the others did
    for i, key in enumerate(KEYS):
        alone, _, _ = _scripted(tokenizer, keys=(key,), group_size=2)
        rows = slice(2 * i, 2 * i + 2)
        k = alone.response_len
        assert torch.equal(alone.response_tokens, traj.response_tokens[rows, :k])
        assert torch.equal(alone.tool_mask, traj.tool_mask[rows, :k])
        assert torch.equal(alone.response_mask, traj.response_mask[rows, :k])
        assert not traj.response_mask[rows, k:].any() and not traj.tool_mask[rows, k:].any()


@pytest.mark.parametrize("max_tool_calls", [0, 1, 2, 5])
def test_max_tool_calls_is_honoured(tokenizer, max_tool_calls):
    traj, gen, _ = _scripted(tokenizer, keys=("C:",), max_tool_calls=max_tool_calls)
    stops = stop_token_ids(tokenizer)
    texts = decode_with_tools(tokenizer, traj, stops)
    calls = min(max_tool_calls, 3)  # C writes three calls
    assert texts == [_expected("C:", max_tool_calls)] * 2
    assert all(t.count("<result>") == calls for t in texts), texts
    assert gen.pop_stats().calls == 2 * calls
    if max_tool_calls == 0:
        assert not traj.tool_mask.any()
        assert texts == [SCRIPTS["C:"]] * 2


@pytest.mark.parametrize("budget", [1, 5, 29, 30, 35, 47, 48, 49, 60])
def test_max_generated_tokens_counts_model_and_tool_tokens(tokenizer, budget):
    traj, _, inner = _scripted(tokenizer, keys=("A:",), max_generated_tokens=budget)
    full = _expected("A:")  # 29 model chars, an 18-token result, then "y." and the stop token
    present = traj.response_mask | traj.tool_mask
    assert traj.response_len <= budget
    assert (present.sum(1) == min(budget, len(full) + 1)).all()
    text = decode_with_tools(tokenizer, traj, stop_token_ids(tokenizer))[0]
    assert text == full[: min(budget, len(full))]
    assert traj.stopped.tolist() == [budget > len(full)] * 2
    # a result that does not fit is cut to the room left, and the row ends there
    assert int(traj.tool_mask[0].sum()) == max(0, min(budget - 29, 18))
    assert all(c["max_generated_tokens"] <= budget for c in inner.calls)


@pytest.mark.parametrize("budget", [20, 28, 40, 45, 75, 90])
def test_budget_is_per_row_when_rows_of_a_turn_have_used_different_amounts(tokenizer, budget):
    # A and C reach the same turns having written 13 vs 12 tokens, etc.: the turn runs with the
    # larger budget left, and each row's tokens past its own budget are dropped
    traj, _, _ = _scripted(tokenizer, keys=("A:", "C:"), group_size=1,
                           max_generated_tokens=budget)
    texts = decode_with_tools(tokenizer, traj, stop_token_ids(tokenizer))
    for row, key in enumerate(("A:", "C:")):
        full = _expected(key)
        assert int((traj.response_mask | traj.tool_mask)[row].sum()) == min(budget, len(full) + 1)
        assert texts[row] == full[: min(budget, len(full))]


def test_no_row_decodes_past_the_models_last_position(tokenizer):
    from types import SimpleNamespace

    # prompts "A:"/"C:" are 3 tokens with BOS; a model of exactly P + max_generated_tokens
    # A and D reach turn 1 having written 13 and 39 tokens: with 47 tokens left, A's turn
    # would let D decode to position 3 + 39 + 47 - 2 > 62
    limit, budget = 3 + 60, 60
    traj, _, inner = _scripted(tokenizer, keys=("A:", "D:"), group_size=1,
                               max_generated_tokens=budget,
                               model=SimpleNamespace(max_seq_len=limit))
    for call in inner.calls:  # forwarded positions: up to length + max_generated_tokens - 2
        assert max(call["lengths"]) + call["max_generated_tokens"] - 2 <= limit - 1, call
    # rows cut by the position cap go on in the next turn: the transcripts are unchanged
    texts = decode_with_tools(tokenizer, traj, stop_token_ids(tokenizer))
    assert texts == [_expected(k)[:budget] for k in ("A:", "D:")]
    assert any(c["max_generated_tokens"] < budget - 13 for c in inner.calls[1:])  # it bound


def test_native_rollout_with_a_tight_context_never_indexes_past_it(tokenizer):
    torch.manual_seed(0)
    tokens, mask = _prompts(tokenizer, ["13*27=", "5="])
    model = tiny_llama(tie_word_embeddings=False, max_seq_len=tokens.shape[1] + 24).eval()
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, 320))
    bias[tokenizer.encode(">", add_bos=False, add_eos=False)[0]] = 3.0  # many turns
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer)
    traj = gen.generate(model, GenerationRequest(tokens, mask, group_size=4,
        max_generated_tokens=24, temperature=1.0, top_k=None,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        logit_bias=bias, prompt_seeds=torch.tensor([3, 4]), forward_batch_size=8))
    assert ((traj.response_mask | traj.tool_mask).sum(1) <= 24).all()
    assert traj.response_len <= 24


def test_a_huge_result_is_cut_to_the_room_left(tokenizer):
    class Flood:
        name = "calculator"

        def __call__(self, arguments):
            return "9" * 10_000_000

    inner = ScriptedGenerator(tokenizer, SCRIPTS, tokenizer.eot_id)
    gen = ToolUseGenerator([Flood()], tokenizer=tokenizer, inner=inner)
    tokens, mask = _prompts(tokenizer, ["A:"])
    traj = gen.generate(None, GenerationRequest(tokens, mask, group_size=1, max_generated_tokens=40,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        temperature=0.0, top_k=None, forward_batch_size=1))
    assert int(traj.tool_mask.sum()) == 40 - 29 and not traj.stopped.any()
    assert decode_with_tools(tokenizer, traj)[0].endswith("<result>999")


def test_a_result_cannot_smuggle_a_stop_token(tokenizer):
    class ParsesSpecials:  # like an HF tokenizer: special-token text becomes the special id
        def __init__(self, inner):
            self.inner = inner

        def encode(self, text, add_bos=True, add_eos=True):
            out = []
            for i, part in enumerate(text.split("<|eot_id|>")):
                out += ([self.inner.eot_id] if i else []) + self.inner.encode(
                    part, add_bos=False, add_eos=False)
            return out

        def decode(self, ids):
            return self.inner.decode(ids)

        vocab_size = property(lambda self: self.inner.vocab_size)

    class Sneaky:
        name = "calculator"

        def __call__(self, arguments):
            return "6<|eot_id|>"

    inner = ScriptedGenerator(tokenizer, SCRIPTS, tokenizer.eot_id)
    gen = ToolUseGenerator([Sneaky()], tokenizer=ParsesSpecials(tokenizer), inner=inner)
    tokens, mask = _prompts(tokenizer, ["A:"])
    traj = gen.generate(None, GenerationRequest(tokens, mask, group_size=1, max_generated_tokens=80,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        temperature=0.0, top_k=None, forward_batch_size=1))
    assert not torch.isin(traj.response_tokens[traj.tool_mask],
                          torch.tensor(stop_token_ids(tokenizer))).any()
    assert decode_with_tools(tokenizer, traj)[0] == _expected("A:")
    assert traj.stopped.all()


def test_seeds_are_per_prompt_sample_and_turn(tokenizer):
    seeds = torch.tensor([11, 22])
    _, _, inner = _scripted(tokenizer, keys=("A:", "C:"), prompt_seeds=seeds)
    assert inner.calls[0]["seeds"] == [11, 22]  # turn 0: the single-turn rollout's seeds
    per_row = mix_seeds(seeds.repeat_interleave(2), torch.arange(2).repeat(2))
    # turns 1 and 2: rows A0, A1, C0, C1 (every '>' ends a turn); turn 3: C0, C1
    assert inner.calls[1]["seeds"] == mix_seeds(per_row, 1).tolist()
    assert inner.calls[2]["seeds"] == mix_seeds(per_row, 2).tolist()
    assert inner.calls[3]["seeds"] == mix_seeds(per_row[2:], 3).tolist()


def test_generator_builds_from_a_config_node(tokenizer):
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    cfg = OmegaConf.create("""
    _component_: torchtune_grpo.rollout.multiturn.ToolUseGenerator
    max_tool_calls: 3
    tools:
      - _component_: torchtune_grpo.rollout.tools.calculator.Calculator
        max_digits: 12
      - _component_: _tool_components.WordCount
    syntax: {call_open: "[{name}:", call_close: "]", result_open: " = ", result_close: ";"}
    inner: {_component_: torchtune_grpo.rollout.native.NativeGenerator}
    """)
    gen = tt_config.instantiate(cfg, tokenizer=tokenizer)
    assert sorted(gen.tools) == ["calculator", "words"] and gen.max_tool_calls == 3
    assert gen.tools["calculator"].max_digits == 12
    assert gen.syntax.format_call("words", "a b") == "[words:a b]"
    assert isinstance(gen.inner, NativeGenerator)
    # "]" ends a call: the only id that may finish one is the "]" byte
    allowed = allowed_token_mask(tokenizer, 320)
    assert gen.close_tag_stop_ids(320, allowed).tolist() == [ord("]")]
    with pytest.raises(ValueError, match="max_tool_calls"):
        ToolUseGenerator([Calculator()], max_tool_calls=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        ToolUseGenerator([Calculator()], inner=NativeGenerator()).generate(None, GenerationRequest(
            torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), group_size=1,
            max_generated_tokens=2, stop_tokens=torch.tensor([0]), pad_id=0, temperature=0.0,
            top_k=None, forward_batch_size=1))


def test_close_tags_ending_in_a_multibyte_character_stop_on_every_partial_byte(tokenizer):
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer,
                           syntax={"call_close": "</{name}»"})
    ids = gen.close_tag_stop_ids(320, allowed_token_mask(tokenizer, 320)).tolist()
    # byte-level: "»" is two bytes, each decoding alone as U+FFFD
    assert ids == list(range(128, 256))


# ---------------------------------------------------------------------------- lockstep
class _ThreadRanks:
    """``all_done`` for ranks that are threads: a logical AND over them (with a timeout)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=20)
        self.values = [False] * world
        self.counts = [0] * world

    def all_done(self, rank: int):
        def reduce(local: bool) -> bool:
            self.counts[rank] += 1
            self.values[rank] = bool(local)
            self.barrier.wait()
            result = all(self.values)
            self.barrier.wait()
            return result

        return reduce


def test_ranks_with_different_workloads_stay_in_lockstep(tokenizer):
    ranks = _ThreadRanks(2)
    keys = {0: ("B:", "A:"), 1: ("C:", "C:")}  # rank 0 finishes two turns before rank 1
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, 320))
    out, errors = {}, []

    def run(rank):
        try:
            out[rank] = _scripted(tokenizer, keys=keys[rank], forward_batch_size=2,
                                  all_done=ranks.all_done(rank), logit_bias=bias)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    calls = {r: out[r][2].calls for r in range(2)}
    # the same inner calls, with the same budgets, micro-batches and decode steps per micro-batch
    shape = {r: [(c["rows"], c["max_generated_tokens"], len(c["steps"])) for c in calls[r]]
             for r in range(2)}
    assert shape[0] == shape[1]
    assert [c["steps"] for c in calls[0]] == [c["steps"] for c in calls[1]]
    assert ranks.counts[0] == ranks.counts[1]
    # rank 0 ran out of rows: its last turns are copies of a finished row, forced to stop
    assert calls[0][-1]["bias_finite"] == len(stop_token_ids(tokenizer))
    assert calls[1][-1]["bias_finite"] == int(torch.isfinite(bias).sum())
    # and each rank's rollout is what it is alone
    for r in range(2):
        alone, _, _ = _scripted(tokenizer, keys=keys[r], forward_batch_size=2, logit_bias=bias)
        assert torch.equal(alone.tokens, out[r][0].tokens)
        assert torch.equal(alone.tool_mask, out[r][0].tool_mask)


@pytest.mark.parametrize("values", [[0], [0, 0], [3, 0], [0, 17], [5, 5, 1], [1000, 7, 64]])
def test_global_max_agrees_on_every_rank(values):
    ranks = _ThreadRanks(len(values))
    got = [None] * len(values)

    def run(rank):
        got[rank] = global_max(values[rank], ranks.all_done(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert got == [max(values)] * len(values)
    assert len(set(ranks.counts)) == 1
    assert global_max(4, None) == 4


# ---------------------------------------------------------------------------- native engine
def _native_setup(tokenizer, *, boost_gt: float | None):
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False).eval()
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, 320))
    gt = tokenizer.encode(">", add_bos=False, add_eos=False)[0]
    if boost_gt is None:
        bias[gt] = float("-inf")  # no token may finish a close tag
    else:
        bias[gt] = boost_gt
    bias[tokenizer.eot_id] = 2.0
    tokens, mask = _left_pad([tokenizer.encode(t, add_bos=True, add_eos=False)
                              for t in ("1+2=", "13*27=", "5=")], tokenizer.pad_id)
    kwargs = dict(group_size=2, max_generated_tokens=24, temperature=1.0, top_k=None,
                  stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
                  logit_bias=bias, prompt_seeds=torch.tensor([5, 6, 7]))
    return model, tokens, mask, kwargs


def test_native_rollout_without_calls_equals_the_inner_engine(tokenizer):
    model, tokens, mask, kwargs = _native_setup(tokenizer, boost_gt=None)
    plain = NativeGenerator().generate(model, GenerationRequest(tokens, mask, forward_batch_size=4,
        **kwargs))
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer)
    tools = gen.generate(model, GenerationRequest(tokens, mask, forward_batch_size=4, **kwargs))
    for name in ("tokens", "prompt_mask", "response_mask", "logprobs", "stopped"):
        assert torch.equal(getattr(plain, name), getattr(tools, name)), name
    assert not tools.tool_mask.any()


def test_native_rollout_is_a_function_of_the_seeds(tokenizer):
    # '>' is likely: rows stop on it (false alarms) and continue in later turns
    model, tokens, mask, kwargs = _native_setup(tokenizer, boost_gt=3.0)
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer)
    a = gen.generate(model, GenerationRequest(tokens, mask, forward_batch_size=4, **kwargs))
    gt = tokenizer.encode(">", add_bos=False, add_eos=False)[0]
    assert (a.response_tokens == gt).any(dim=1).sum() >= 3  # the multi-turn path was taken
    b = gen.generate(model, GenerationRequest(tokens, mask, forward_batch_size=1, **kwargs))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # the last prompt alone, with its own seed: the same two completions
    alone = gen.generate(model, GenerationRequest(tokens[2:], mask[2:], forward_batch_size=4,
        **{**kwargs, "prompt_seeds": torch.tensor([7])}))
    k = alone.response_len
    assert torch.equal(alone.response_tokens, a.response_tokens[4:, :k])
    assert not a.response_mask[4:, k:].any()


# ---------------------------------------------------------------------------- a model that calls
TRANSCRIPTS = {"Q7:": "<calculator>12*7</calculator><result>84</result>=84",
               "Q8:": "no>call<result>1</result>!"}


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory):
    """A tiny model overfitted to two transcripts: one with a calculator call, one whose
    ``>`` is a false alarm and whose ``<result>`` tags the model writes itself."""
    from torchtune_grpo.quickstart.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    torch.manual_seed(0)
    model = tiny_llama()
    seqs = [tokenizer.encode(k + v, add_bos=True, add_eos=False) + [tokenizer.eot_id]
            for k, v in TRANSCRIPTS.items()]
    x, m = _left_pad([s[::-1] for s in seqs], tokenizer.pad_id)  # right-pad
    x, m = x.flip(1), m.flip(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(100):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(),
                                                 reduction="none")
        loss = (loss * m[:, 1:].flatten()).sum() / m[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


def _calling_rollout(model, tokenizer, keys=tuple(TRANSCRIPTS), inner=None, **overrides):
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, 320))
    tokens, mask = _prompts(tokenizer, list(keys))
    gen = ToolUseGenerator([Calculator()], tokenizer=tokenizer, max_tool_calls=2, inner=inner)
    kwargs = dict(group_size=1, max_generated_tokens=60, temperature=0.0, top_k=None,
                  stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
                  logit_bias=bias, forward_batch_size=2)
    request = GenerationRequest(tokens, mask, **{**kwargs, **overrides})
    return gen.generate(model, request), gen, bias


def test_native_rollout_runs_the_tool_and_logprobs_match_the_training_forward(calling_model):
    model, tokenizer = calling_model
    traj, gen, bias = _calling_rollout(model, tokenizer)
    stops = stop_token_ids(tokenizer)
    assert decode_with_tools(tokenizer, traj, stops) == list(TRANSCRIPTS.values())
    assert traj.stopped.all()
    result = "<result>84</result>"
    start = TRANSCRIPTS["Q7:"].index(result)
    assert traj.tool_mask[0].nonzero().squeeze(1).tolist() == list(range(start,
                                                                          start + len(result)))
    assert not traj.tool_mask[1].any()  # the model's own "<result>" is policy text
    assert gen.pop_stats().calls == 1
    # the rollout's log-probs are the policy's under the whole context, tool tokens attended
    with torch.no_grad():
        lp, _ = micro_batch_logprobs(model, traj.tokens, traj.prompt_mask, traj.response_mask,
                                     tool_mask=traj.tool_mask, logit_bias=bias)
        lp_full, _ = micro_batch_logprobs(model, traj.tokens, traj.prompt_mask,
                                          traj.response_mask, tool_mask=traj.tool_mask,
                                          logit_bias=bias, trim=False)
        blind, _ = micro_batch_logprobs(model, traj.tokens, traj.prompt_mask,
                                        traj.response_mask, logit_bias=bias)
    policy = traj.response_mask
    torch.testing.assert_close(lp[policy], traj.logprobs[policy], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=0)
    assert (lp[traj.tool_mask] == 0).all()
    # without the tool mask the result tokens would be hidden as padding: the tokens after
    # the result would be scored in another context
    after = policy[0] & (torch.arange(traj.response_len) > start + len(result))
    assert (blind[0][after] - traj.logprobs[0][after]).abs().max() > 1e-3


def _fsdp_worker(rank: int, port: int, state_path: str, tok_dir: str, out_dir: str) -> None:
    """One of 2 ranks: shard the calling model with FSDP2 (every forward is a collective) and
    roll out this rank's prompts; save the rollout and the inner engine's call count."""
    import os

    from omegaconf import OmegaConf

    from torchtune_grpo import distributed as D
    from torchtune_grpo.policy.model import build_model
    from torchtune_grpo.quickstart.tiny import tiny_tokenizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    D.init_distributed(torch.device("cpu"))
    try:
        tokenizer = tiny_tokenizer(tok_dir)
        tiny = {"_component_": "torchtune_grpo.quickstart.tiny.tiny_llama"}
        model = build_model(OmegaConf.create(tiny),
                            torch.load(state_path), device=torch.device("cpu"),
                            dtype=torch.float32, world_size=2, trainable=False)
        counter = _CountingNative()
        traj, _, _ = _calling_rollout(
            model, tokenizer, keys=FSDP_KEYS[rank], inner=counter,
            all_done=lambda local: D.WORLD.all_ranks_true(local, torch.device("cpu")))
        torch.save({"tokens": traj.tokens, "tool_mask": traj.tool_mask,
                    "response_mask": traj.response_mask, "logprobs": traj.logprobs,
                    "calls": counter.calls}, f"{out_dir}/rank{rank}.pt")
        # both ranks reach the teardown together: without this, gloo's destroy aborted one
        # rank ("terminate called without an active exception") in 5 of 20 runs here
        D.WORLD.barrier()
    finally:
        D.destroy()


class _CountingNative(NativeGenerator):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return super().generate(*args, **kwargs)


#: every '>' ends a turn: Q7 takes 3 turns (a false alarm, the call, the end), Q8 4 (three
#: false alarms: "no>", "<result>", "</result>", then the end), so rank 0 idles in turn 4
FSDP_KEYS = {0: ["Q7:", "Q7:"], 1: ["Q8:", "Q7:"]}


@pytest.mark.distributed
def test_two_fsdp_ranks_with_different_turns_match_one_process(calling_model, tmp_path):
    import torch.multiprocessing as mp

    from tests.recipes._helpers import free_port

    model, tokenizer = calling_model
    state_path = tmp_path / "state.pt"
    torch.save(model.state_dict(), state_path)
    tok_dir = tmp_path / "tok"
    from torchtune_grpo.quickstart.tiny import write_tiny_tokenizer

    write_tiny_tokenizer(tok_dir)
    mp.spawn(_fsdp_worker, args=(free_port(), str(state_path), str(tok_dir), str(tmp_path)),
             nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        alone, _, _ = _calling_rollout(model, tokenizer, keys=FSDP_KEYS[rank])
        k = alone.response_len
        assert torch.equal(got["tokens"][:, : alone.tokens.shape[1]], alone.tokens)
        assert not got["response_mask"][:, k:].any()
        assert torch.equal(got["tool_mask"][:, :k], alone.tool_mask)
        torch.testing.assert_close(got["logprobs"][:, :k], alone.logprobs, atol=1e-5, rtol=0)
    calls = [torch.load(tmp_path / f"rank{r}.pt")["calls"] for r in range(2)]
    assert calls[0] == calls[1] == 4  # rank 0 followed rank 1's fourth turn


# ---------------------------------------------------------------------------- masking in the loss
def _two_turn_batch(tokenizer):
    traj, _, _ = _scripted(tokenizer, keys=("A:", "B:"), group_size=1)
    advantages = torch.tensor([1.0, -1.0])
    return traj, advantages


def _grads(model, traj, advantages, *, logit_noise=None, logprob_noise=None,
           response_mask=None):
    """Parameter gradients of the GRPO loss (KL and entropy terms on) on ``traj``."""
    model.zero_grad(set_to_none=True)
    hook = None
    if logit_noise is not None:  # perturb the final hidden states (so the logits) at tool slots
        def add_noise(module, args, output):
            width = output.shape[1]
            return output + logit_noise[:, :width, None] * traj.tool_mask[:, :width, None]
        hook = model.norm.register_forward_hook(add_noise)
    try:
        logprobs, entropy = micro_batch_logprobs(
            model, traj.tokens, traj.prompt_mask, traj.response_mask, tool_mask=traj.tool_mask,
            return_entropy=True)
    finally:
        if hook is not None:
            hook.remove()
    if logprob_noise is not None:
        logprobs = logprobs + logprob_noise * traj.tool_mask
        entropy = entropy + logprob_noise * traj.tool_mask
    mask = traj.response_mask if response_mask is None else response_mask
    loss_fn = GRPOLoss(kl_coeff=0.1, entropy_coeff=0.01, aggregation="token_mean")
    ref = traj.logprobs - 0.05 + 7.0 * traj.tool_mask  # garbage where tools wrote
    loss, _ = loss_fn(logprobs, traj.logprobs, advantages, mask,
                      normalizer=loss_fn.normalizer_contribution(mask), ref_logprobs=ref,
                      entropy=entropy)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradients_ignore_the_tool_positions_bit_for_bit(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama()
    traj, advantages = _two_turn_batch(tokenizer)
    assert traj.tool_mask[0].sum() == 18 and not traj.tool_mask[1].any()
    loss, grads = _grads(model, traj, advantages)
    noise = torch.randn(traj.tool_mask.shape) * 10
    for kwargs in ({"logit_noise": noise}, {"logprob_noise": noise}):
        noisy_loss, noisy = _grads(model, traj, advantages, **kwargs)
        assert torch.equal(loss, noisy_loss)
        for name, g in grads.items():
            assert torch.equal(g, noisy[name]), (kwargs.keys(), name)
    # the same perturbation does reach the loss if tool tokens were counted as actions
    present = traj.response_mask | traj.tool_mask
    base, _ = _grads(model, traj, advantages, response_mask=present)
    leaked, _ = _grads(model, traj, advantages, response_mask=present, logprob_noise=noise)
    assert not torch.equal(base, leaked)


def test_logprob_gradient_is_exactly_zero_on_tool_tokens(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama()
    traj, advantages = _two_turn_batch(tokenizer)
    logprobs, _ = micro_batch_logprobs(model, traj.tokens, traj.prompt_mask, traj.response_mask,
                                       tool_mask=traj.tool_mask)
    logprobs.retain_grad()
    loss_fn = GRPOLoss()
    loss, _ = loss_fn(logprobs, logprobs.detach(), advantages, traj.response_mask,
                      normalizer=loss_fn.normalizer_contribution(traj.response_mask))
    loss.backward()
    assert (logprobs.grad[traj.tool_mask] == 0).all()
    assert (logprobs.grad[traj.response_mask] != 0).all()


def test_loss_equals_hand_computed_value_on_a_two_turn_example():
    # row 0: two policy tokens, a 2-token tool result, two policy tokens (2 turns);
    # row 1: three policy tokens, then padding. Tool slots hold garbage log-probs.
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    tool_mask = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    new = torch.tensor([[-1.0, -0.5, -50.0, 9.0, -0.2, -0.1], [-0.3, -0.7, -0.2, 0, 0, 0]])
    old = torch.tensor([[-1.1, -0.5, 3.0, -40.0, -0.4, -0.1], [-0.3, -0.6, -0.2, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5])

    def pg(lp, lo, a, eps=0.2):
        r = math.exp(lp - lo)
        return max(-r * a, -min(max(r, 1 - eps), 1 + eps) * a)

    row0 = [pg(-1.0, -1.1, 1.0), pg(-0.5, -0.5, 1.0), pg(-0.2, -0.4, 1.0), pg(-0.1, -0.1, 1.0)]
    row1 = [pg(-0.3, -0.3, -0.5), pg(-0.7, -0.6, -0.5), pg(-0.2, -0.2, -0.5)]
    # by hand: -(e^0.1 + 1 + 1.2 (clipped) + 1) + 0.5 * (1 + e^-0.1 + 1), over 7 policy tokens
    by_hand = (-(math.exp(0.1) + 1 + 1.2 + 1) + 0.5 * (1 + math.exp(-0.1) + 1)) / 7
    assert sum(row0 + row1) / 7 == pytest.approx(by_hand, abs=1e-12)

    token_mean = GRPOLoss(aggregation="token_mean")
    normalizer = token_mean.normalizer_contribution(response_mask)
    assert normalizer.item() == 7  # tool tokens are not counted
    loss, stats = token_mean(new, old, adv, response_mask, normalizer=normalizer)
    assert loss.item() == pytest.approx(by_hand, abs=1e-6)
    assert stats["tokens"].item() == 7
    sequence_mean = GRPOLoss(aggregation="sequence_mean")
    loss, _ = sequence_mean(new, old, adv, response_mask,
                            normalizer=sequence_mean.normalizer_contribution(response_mask))
    assert loss.item() == pytest.approx((sum(row0) / 4 + sum(row1) / 3) / 2, abs=1e-6)
    # counting the tool slots as actions would give another value
    present = response_mask | tool_mask
    wrong, _ = token_mean(new, old, adv, present,
                          normalizer=token_mean.normalizer_contribution(present))
    assert abs(wrong.item() - by_hand) > 0.01
