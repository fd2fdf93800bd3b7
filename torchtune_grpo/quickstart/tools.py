"""The tool quickstart: multiplication the tiny model cannot do in its head, and a calculator.

Its warm-up (:func:`tool_warmup`) shows the calculator call in a minority (``tool_fraction``)
of demonstrations and copy drills that never train the choice to call, so GRPO, rewarded for
the final answer only, has to make the call the mode; ``docs/quickstart_tools.md`` explains
it. :func:`tool_heldout_success` measures held-out greedy success and tool calls.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from torchtune_grpo.quickstart.prepare import (
    QUICKSTART_MODEL_DIMS,
    encode_prompt,
    load_quickstart_model,
    train_on_demonstrations,
)
from torchtune_grpo.quickstart.tiny import tiny_llama, tiny_tokenizer, write_hf_checkpoint

#: Where the shipped ``grpo/quickstart_cpu_tools`` config looks for the model.
DEFAULT_TOOLS_QUICKSTART_DIR = "/tmp/tune_grpo_quickstart_tools/base"
#: Tool warm-up defaults: optimizer steps and share of demonstrations that call the tool.
TOOL_WARMUP_STEPS = 1000
TOOL_WARMUP_BATCH_SIZE = 32
TOOL_WARMUP_LR = 3e-3
TOOL_FRACTION = 0.25
#: Loss weight of a tool demonstration's tokens after the first (see :func:`tool_warmup`).
TOOL_WEIGHT = 3.0
#: Copy drills added to each warm-up batch (see :func:`copy_drills`): result -> answer drills
#: (a random number, no prompt) and operands -> call drills (the call's first token untrained).
TOOL_ANSWER_DRILLS = 32
TOOL_CALL_DRILLS = 16
#: Response budget of the tool task (model and tool tokens, as ``max_generated_tokens``).
TOOL_MAX_NEW = 72


@torch.no_grad()
def tool_rollout(model, tokenizer, questions: list[str], *, tools: bool = True,
                 max_new: int = TOOL_MAX_NEW) -> tuple[list[str], float]:
    """Greedy multi-turn completions of plain-text ``questions`` with the training rollout engine.

    Args:
        model: a quickstart model.
        tokenizer: its tokenizer.
        questions: prompts (encoded after BOS, no template).
        tools: False runs the same engine with no tool (a call gets no result).
        max_new: response budget, model and tool tokens together.

    Returns:
        ``(texts, calls_per_completion)``: each completion's text (model and tool tokens) and
        the mean tool calls per completion (with ``tools=False``: the unanswered
        ``</calculator>`` tags).
    """
    from torchtune_grpo.rollout.multiturn import ToolUseGenerator
    from torchtune_grpo.rollout.native import NativeGenerator
    from torchtune_grpo.rollout.protocol import GenerationRequest
    from torchtune_grpo.rollout.tool_trajectory import decode_with_tools
    from torchtune_grpo.rollout.tools.calculator import Calculator
    from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax
    from torchtune_grpo.token_rules import allowed_token_mask, logit_bias_from_mask

    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, q) for q in questions]
    width = max(map(len, prompts))
    pad_id = int(getattr(tokenizer, "pad_id", 0))
    tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    vocab = model.output.out_features if hasattr(model.output, "out_features") \
        else QUICKSTART_MODEL_DIMS["vocab_size"]
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, vocab))
    stops = torch.tensor(sorted(set(tokenizer.stop_tokens)))
    generator = ToolUseGenerator(tools=[Calculator()] if tools else [], tokenizer=tokenizer,
                                 inner=NativeGenerator())
    traj = generator.generate(model, GenerationRequest(
        tokens, mask, group_size=1, max_generated_tokens=max_new, stop_tokens=stops,
        pad_id=pad_id, temperature=0.0, top_k=None, logit_bias=bias,
        forward_batch_size=len(prompts)))
    stats = generator.pop_stats()
    model.train(was_training)
    texts = decode_with_tools(tokenizer, traj, stops.tolist())
    if not tools:
        close = ToolCallSyntax().close_tag(Calculator().name)
        return texts, sum(t.count(close) for t in texts) / max(len(texts), 1)
    return texts, stats.calls / max(stats.completions, 1)


def tool_heldout_success(checkpoint_dir: str | Path, *, tools: bool = True,
                         limit: int | None = None) -> tuple[float, float]:
    """Held-out greedy success (the number after the last ``Answer:``) and tool-call rate of a
    tool-quickstart checkpoint on the multiplication ``test`` split.

    Args:
        checkpoint_dir: an HF model folder (the prepared base or ``<output_dir>/step_<N>``).
        tools: False evaluates with the calculator disabled.
        limit: evaluate only the first ``limit`` held-out problems.

    Returns:
        ``(success, calls_per_completion)``.
    """
    from torchtune_grpo.datasets.multiplication import (
        MULTIPLICATION_ANSWER_PHRASE,
        multiplication_problems,
    )
    from torchtune_grpo.rewards.components import NumericCorrectness

    model, tokenizer = load_quickstart_model(checkpoint_dir)
    problems = multiplication_problems("test")[:limit]
    texts, calls = tool_rollout(model, tokenizer, [q for q, _ in problems], tools=tools)
    reward = NumericCorrectness(answer_tag=None, answer_phrase=MULTIPLICATION_ANSWER_PHRASE)
    scores = reward(texts, [a for _, a in problems])
    return sum(scores) / len(scores), calls


def direct_guess(answer: str, rng: random.Random) -> str:
    """A plausible wrong product: a number within 20% of ``answer``, never ``answer`` itself.

    The direct (no-tool) demonstrations of the tool warm-up answer with such guesses, so the
    model learns the answer's form and rough size but cannot learn the exact product.
    """
    value = int(answer)
    while True:
        guess = round(value * rng.uniform(0.8, 1.2))
        if guess != value and guess > 0:
            return str(guess)


def tool_demonstration(question: str, answer: str, *, use_tool: bool,
                       rng: random.Random) -> list[tuple[str, bool]]:
    """One warm-up demonstration as ``(text, trained)`` segments: with ``use_tool`` the call
    (trained), the tool's result (not trained) and ``Answer: N`` (trained); otherwise only
    ``Answer:`` with :func:`direct_guess`. The end-of-turn token is the caller's.
    """
    from torchtune_grpo.datasets.multiplication import MULTIPLICATION_ANSWER_PHRASE
    from torchtune_grpo.rollout.tools.calculator import Calculator
    from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax

    if not use_tool:
        return [(f"{MULTIPLICATION_ANSWER_PHRASE} {direct_guess(answer, rng)}", True)]
    expression = question.removeprefix("What is ").removesuffix("?")
    syntax, name = ToolCallSyntax(), Calculator().name
    return [(syntax.format_call(name, expression), True),
            (syntax.format_result(answer), False),
            (f"{MULTIPLICATION_ANSWER_PHRASE} {answer}", True)]


def copy_drills(tokenizer, problems, rng: random.Random, *, answer_drills: int,
                call_drills: int) -> list[tuple[list[int], list[tuple[list[int], float]]]]:
    """Copy exercises for the tool warm-up, as ``(prompt ids, segments)``.

    ``answer_drills``: BOS, ``<result>N</result>`` (weight 0), then the trained ``Answer: N`` and
    end of turn, ``N`` a random 4-5 digit number. ``call_drills``: a ``warmup`` question and its
    call, the call's first token at weight 0. No drill trains the choice to call.
    """
    from torchtune_grpo.datasets.multiplication import MULTIPLICATION_ANSWER_PHRASE
    from torchtune_grpo.rollout.tools.calculator import Calculator
    from torchtune_grpo.rollout.tools.syntax import ToolCallSyntax

    syntax, name = ToolCallSyntax(), Calculator().name

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False, add_eos=False)

    out = []
    for _ in range(answer_drills):
        number = str(rng.randrange(1000, 100000))
        out.append(([tokenizer.bos_id], [
            (encode(syntax.format_result(number)), 0.0),
            (encode(f"{MULTIPLICATION_ANSWER_PHRASE} {number}") + [tokenizer.eot_id], 1.0)]))
    for _ in range(call_drills):
        question, _ = problems[rng.randrange(len(problems))]
        expression = question.removeprefix("What is ").removesuffix("?")
        call = encode(syntax.format_call(name, expression))
        out.append((encode_prompt(tokenizer, question), [(call[:1], 0.0), (call[1:], 1.0)]))
    return out


def tool_warmup(model, tokenizer, problems, *, steps: int,
                batch_size: int = TOOL_WARMUP_BATCH_SIZE,
                lr: float = TOOL_WARMUP_LR, tool_fraction: float = TOOL_FRACTION,
                tool_weight: float = TOOL_WEIGHT, answer_drills: int = TOOL_ANSWER_DRILLS,
                call_drills: int = TOOL_CALL_DRILLS, seed: int = 0) -> None:
    """Teacher-forced warm-up on multiplication demonstrations, a ``tool_fraction`` of them calling
    the tool, the others answering with a plausible wrong guess.

    The loss covers the model's text, never the tool's result; ``tool_weight`` scales a tool
    demonstration's tokens after its first; each batch adds ``answer_drills`` + ``call_drills``
    (:func:`copy_drills`); the learning rate decays along a half cosine.
    """
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    if tool_weight <= 0:
        raise ValueError(f"tool_weight must be > 0, got {tool_weight}")
    rng = random.Random(seed)
    eot = tokenizer.eot_id

    def demonstrate():
        question, answer = problems[rng.randrange(len(problems))]
        use_tool = rng.random() < tool_fraction
        segments = tool_demonstration(question, answer, use_tool=use_tool, rng=rng)
        weight = tool_weight if use_tool else 1.0
        ids = [(tokenizer.encode(text, add_bos=False, add_eos=False), trained)
               for text, trained in segments] + [([eot], True)]
        out = [(ids[0][0][:1], 1.0), (ids[0][0][1:], weight)]
        out += [(t, weight if trained else 0.0) for t, trained in ids[1:]]
        return encode_prompt(tokenizer, question), out

    def drills():
        return copy_drills(tokenizer, problems, rng, answer_drills=answer_drills,
                           call_drills=call_drills)

    train_on_demonstrations(model, tokenizer, demonstrate, steps=steps, batch_size=batch_size,
                             lr=lr, group_by_length=True,
                             drills=drills if answer_drills or call_drills else None,
                             cosine=True)


def prepare_tools_quickstart(output_dir: str | Path = DEFAULT_TOOLS_QUICKSTART_DIR, *,
                             warmup_steps: int = TOOL_WARMUP_STEPS, seed: int = 0,
                             tool_fraction: float = TOOL_FRACTION,
                             tool_weight: float = TOOL_WEIGHT) -> Path:
    """Write the tool quickstart's starting model and tokenizer into ``output_dir`` (the tiny model
    warmed up by :func:`tool_warmup`); deterministic for a given ``seed`` and thread count.

    Args:
        output_dir: folder the ``grpo/quickstart_cpu_tools`` config reads (``model_dir``).
        warmup_steps: supervised warm-up steps (0: random weights).
        seed: seed of the initial weights and the warm-up.
        tool_fraction: share of warm-up demonstrations that call the tool.
        tool_weight: loss weight of a tool demonstration's tokens after its first one.

    Returns:
        ``output_dir``.
    """
    from torchtune_grpo.datasets.multiplication import multiplication_problems

    torch.manual_seed(seed)
    output_dir = Path(output_dir)
    tokenizer = tiny_tokenizer(output_dir)
    model = tiny_llama(**QUICKSTART_MODEL_DIMS)
    if warmup_steps:
        tool_warmup(model, tokenizer, multiplication_problems("warmup"), steps=warmup_steps,
                    tool_fraction=tool_fraction, tool_weight=tool_weight, seed=seed)
    return write_hf_checkpoint(model, output_dir, QUICKSTART_MODEL_DIMS)
