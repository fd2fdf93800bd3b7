"""The CPU quickstart: a task, a tiny model and its starting weights, made locally.

The task (:mod:`torchtune_grpo.datasets.addition`) is adding 1111 to a four-digit number
written as text (``"3812+1111="`` -> ``"4923"``): every prompt needs its own answer, answers
are checked by the same numeric reward GSM8K uses, and problems split into disjoint train,
held-out and warm-up sets.

A randomly initialised model never answers correctly, so its groups would have no reward
variance and GRPO would have nothing to learn from. ``prepare`` therefore gives the tiny model
a short supervised warm-up on the separate ``warmup`` split, on *noisy demonstrations*: only
a fraction (``correct_fraction``, default 0.3) of them show the right sum; the others show the
typical wrong answer, the first operand echoed back (``"3812+1111="`` -> ``"3812"``). The
warmed-up model has the right behaviour in its distribution but not as its mode: sampling
answers correctly some of the time (groups have reward variance) while greedy decoding
mostly echoes (low starting held-out success). GRPO, rewarded only by correctness, has to
find and amplify the right behaviour, and held-out greedy success shows whether it did
(an SFT-then-RL pipeline in miniature, with deliberately poor SFT data).

The **tool quickstart** (``--tools``, config ``grpo/quickstart_cpu_tools``) is built the same
way on a task the model cannot do in its head, multiplying a two-digit by a three-digit number
(:mod:`torchtune_grpo.datasets.multiplication`): its warm-up (:func:`tool_warmup`) shows the
model calling the calculator (``<calculator>37*412</calculator><result>15244</result>Answer:
15244``) in only a minority (``tool_fraction``, default 0.25) of demonstrations, the others
answering directly with a plausible wrong guess, plus copy drills (:func:`copy_drills`) that
teach copying the operands into a call and a result into the answer without ever training the
choice to call. Greedy decoding then answers in its head (and wrongly); GRPO, rewarded only
for the final answer, has to make the tool call the mode.

Commands::

    tune-grpo prepare-quickstart [--output-dir DIR] [--seed S] [--warmup-steps N]
                                 [--correct-fraction F]
    tune-grpo prepare-quickstart --evaluate CHECKPOINT_DIR [CHECKPOINT_DIR ...]
    tune-grpo prepare-quickstart --tools [--output-dir DIR] [--seed S] [--warmup-steps N]
                                 [--tool-fraction F] [--tool-weight W]
    tune-grpo prepare-quickstart --tools --evaluate [--no-tool-results] CHECKPOINT_DIR ...

The ``--evaluate`` forms print the held-out greedy success of saved checkpoints (for example
``<output_dir>/step_<N>`` of a run; with ``--tools`` also the tool calls per completion) and
write nothing.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtune_grpo.datasets.addition import addition_problems
from torchtune_grpo.quickstart.tiny import TINY_MODEL_DIMS, tiny_llama, tiny_tokenizer, write_hf_checkpoint

#: Where the shipped ``grpo/quickstart_cpu`` config looks for the model.
DEFAULT_QUICKSTART_DIR = "/tmp/tune_grpo_quickstart/base"
#: Builder arguments of the quickstart model (must match ``model`` in ``grpo/quickstart_cpu``).
QUICKSTART_MODEL_DIMS = dict(TINY_MODEL_DIMS)
#: Warm-up defaults: optimizer steps, batch size, learning rate, share of correct demonstrations.
WARMUP_STEPS = 500
WARMUP_BATCH_SIZE = 64
WARMUP_LR = 3e-3
CORRECT_FRACTION = 0.3

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


def _encode_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(question, add_bos=True, add_eos=False)


def echo_answer(question: str) -> str:
    """The wrong demonstration: the first operand (``"3812+1111="`` -> ``"3812"``)."""
    return question.split("+", 1)[0]


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def greedy_completions(model, tokenizer, questions: list[str], max_new: int = 5,
                       batch_size: int = 512) -> list[str]:
    """Greedy completions of plain-text ``questions`` (batched, no KV cache; small models only).

    Questions are batched by prompt length, so no padding is needed. A completion ends before
    the first stop token or after ``max_new`` tokens.
    """
    was_training = model.training
    model.eval()
    vocab = tokenizer.vocab_size
    stops = set(tokenizer.stop_tokens)
    prompts = [_encode_prompt(tokenizer, q) for q in questions]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    out = [""] * len(questions)
    for length, rows in by_length.items():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            ids = torch.tensor([prompts[i] for i in chunk])
            for _ in range(max_new):
                nxt = model(ids)[:, -1, :vocab].argmax(-1)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            for i, row in zip(chunk, ids[:, length:].tolist(), strict=True):
                cut = next((k for k, t in enumerate(row) if t in stops), len(row))
                out[i] = tokenizer.decode(row[:cut])
    model.train(was_training)
    return out


def greedy_accuracy(model, tokenizer, problems: list[tuple[str, str]], max_new: int = 5) -> float:
    """Greedy success on ``(question, answer)`` problems, scored like training.

    A completion succeeds when :class:`~torchtune_grpo.rewards.components.NumericCorrectness`
    (``answer_tag=None``, the quickstart's reward) gives it 1.
    """
    from torchtune_grpo.rewards.components import NumericCorrectness

    if not problems:
        return 0.0
    completions = greedy_completions(model, tokenizer, [q for q, _ in problems], max_new)
    scores = NumericCorrectness(answer_tag=None)(completions, [a for _, a in problems])
    return sum(scores) / len(scores)


def load_quickstart_model(checkpoint_dir: str | Path, dims: dict | None = None):
    """Load a quickstart model (HF safetensors, e.g. ``<output_dir>/step_<N>``) and its tokenizer.

    Returns:
        ``(model, tokenizer)``: the torchtune model in eval mode and the tiny tokenizer.
    """
    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune

    checkpoint_dir = Path(checkpoint_dir)
    dims = dims or QUICKSTART_MODEL_DIMS
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {checkpoint_dir}")
    hf_state: dict[str, torch.Tensor] = {}
    for f in files:
        hf_state.update(load_file(str(f)))
    state = hf_to_tune(hf_state, num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"],
                       dim=dims["embed_dim"])
    model = tiny_llama(**dims)
    model.load_state_dict(state, strict=False)  # the output projection is tied
    model.eval()
    return model, tiny_tokenizer(checkpoint_dir)


def heldout_success(checkpoint_dir: str | Path) -> float:
    """Greedy success of a saved quickstart checkpoint on the held-out ``test`` split."""
    model, tokenizer = load_quickstart_model(checkpoint_dir)
    return greedy_accuracy(model, tokenizer, addition_problems("test"))


@torch.no_grad()
def tool_rollout(model, tokenizer, questions: list[str], *, tools: bool = True,
                 max_new: int = TOOL_MAX_NEW) -> tuple[list[str], float]:
    """Greedy multi-turn completions of plain-text ``questions`` with the calculator.

    Runs the rollout engine of training (:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`
    around :class:`~torchtune_grpo.rollout.native.NativeGenerator`) at temperature 0.

    Args:
        model: a quickstart model.
        tokenizer: its tokenizer.
        questions: prompts (encoded after BOS, no template).
        tools: False runs the same engine with no tool (a call gets no result: the negative
            control's rollout).
        max_new: response budget, model and tool tokens together.

    Returns:
        ``(texts, calls_per_completion)``: each completion's whole text (model and tool
        tokens, stop token left out), and the mean number of tool calls per completion: the
        results the tool gave, or with ``tools=False`` the calls the model wrote
        (``</calculator>`` tags) that got no result.
    """
    from torchtune_grpo.rollout.native import (
        NativeGenerator,
        allowed_token_mask,
        logit_bias_from_mask,
    )
    from torchtune_grpo.rollout.multiturn import ToolUseGenerator, decode_with_tools
    from torchtune_grpo.rollout.tools import Calculator, ToolCallSyntax

    was_training = model.training
    model.eval()
    prompts = [_encode_prompt(tokenizer, q) for q in questions]
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
    traj = generator.generate(model, tokens, mask, group_size=1, max_generated_tokens=max_new,
                              stop_tokens=stops, pad_id=pad_id, temperature=0.0, top_k=None,
                              logit_bias=bias, forward_batch_size=len(prompts))
    stats = generator.pop_stats()
    model.train(was_training)
    texts = decode_with_tools(tokenizer, traj, stops.tolist())
    if not tools:
        close = ToolCallSyntax().close_tag(Calculator().name)
        return texts, sum(t.count(close) for t in texts) / max(len(texts), 1)
    return texts, stats.calls / max(stats.completions, 1)


def tool_heldout_success(checkpoint_dir: str | Path, *, tools: bool = True,
                         limit: int | None = None) -> tuple[float, float]:
    """Held-out greedy success and tool-call rate of a tool-quickstart checkpoint.

    Greedy multi-turn rollouts (:func:`tool_rollout`) on the multiplication ``test`` split,
    scored like training: :class:`~torchtune_grpo.rewards.components.NumericCorrectness` on the
    number after the last ``Answer:``.

    Args:
        checkpoint_dir: an HF model folder (the prepared base or ``<output_dir>/step_<N>``).
        tools: False evaluates with the calculator disabled (calls get no result).
        limit: evaluate only the first ``limit`` held-out problems.

    Returns:
        ``(success, calls_per_completion)`` (see :func:`tool_rollout` for the calls with
        ``tools=False``).
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


# ------------------------------------------------------------------------------ warm-up
def _train_on_demonstrations(model, tokenizer, demonstrate, *, steps: int, batch_size: int,
                             lr: float, group_by_length: bool = False, drills=None,
                             cosine: bool = False) -> None:
    """Teacher-forced cross-entropy: ``demonstrate()`` gives ``(prompt ids, segments)``.

    ``segments`` is a list of ``(token ids, weight)``: the loss covers the tokens of the
    segments with a non-zero weight (the model's own text: True or a float), never the prompt
    or the segments with weight 0 / False (a tool's result: context, as in a GRPO rollout).
    The loss is the weighted mean over the batch's trained tokens; ``group_by_length`` runs
    one forward per distinct sequence length (no padding: demonstrations of very different
    lengths cost what they hold). ``drills()``, if given, returns more ``(prompt ids, segments)``
    to add to each batch; ``cosine`` decays the learning rate to 0 along a half cosine.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * s / steps))) if cosine else None
    for _ in range(steps):
        seqs, masks = [], []
        batch = [demonstrate() for _ in range(batch_size)] + (drills() if drills else [])
        for prompt, segments in batch:
            seq, mask = list(prompt), [0] * len(prompt)
            for ids, weight in segments:
                seq += ids
                mask += [float(weight)] * len(ids)
            seqs.append(seq)
            masks.append(mask)
        if group_by_length:
            groups: dict[int, list[int]] = {}
            for i, seq in enumerate(seqs):
                groups.setdefault(len(seq), []).append(i)
            chunks = [rows for _, rows in sorted(groups.items())]
        else:
            chunks = [list(range(len(seqs)))]
        total = float(sum(sum(m[1:]) for m in masks))
        loss = torch.zeros(())
        for rows in chunks:
            width = max(len(seqs[i]) for i in rows)
            tokens = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in rows])
            weight = torch.tensor([masks[i] + [0] * (width - len(masks[i])) for i in rows],
                                  dtype=torch.float32)
            logits = model(tokens[:, :-1])
            token_loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(),
                                         reduction="none")
            if len(chunks) == 1:  # the quickstart's original arithmetic, bit for bit
                loss = (token_loss * weight[:, 1:].flatten()).sum() / weight[:, 1:].sum()
            else:
                loss = loss + (token_loss * weight[:, 1:].flatten()).sum() / total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def supervised_warmup(model, tokenizer, problems, *, steps: int,
                      batch_size: int = WARMUP_BATCH_SIZE, lr: float = WARMUP_LR,
                      correct_fraction: float = CORRECT_FRACTION, seed: int = 0) -> None:
    """Teacher-forced cross-entropy on noisy demonstrations of ``problems``.

    Each sampled problem is shown with its right answer with probability
    ``correct_fraction`` and with :func:`echo_answer` otherwise; the loss covers the answer
    tokens and the end-of-turn token.
    """
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"correct_fraction must be in [0, 1], got {correct_fraction}")
    rng = random.Random(seed)
    eot = tokenizer.eot_id

    def demonstrate():
        question, answer = problems[rng.randrange(len(problems))]
        shown = answer if rng.random() < correct_fraction else echo_answer(question)
        target = tokenizer.encode(shown, add_bos=False, add_eos=False) + [eot]
        return _encode_prompt(tokenizer, question), [(target, True)]

    _train_on_demonstrations(model, tokenizer, demonstrate, steps=steps, batch_size=batch_size,
                             lr=lr)


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
    """One warm-up demonstration of the multiplication task as ``(text, trained)`` segments.

    With ``use_tool`` the model calls the calculator and copies its result into the answer::

        [("<calculator>37*412</calculator>", True), ("<result>15244</result>", False),
         ("Answer: 15244", True)]

    (the result segment is the tool's text: context, not trained on); otherwise it answers
    directly with :func:`direct_guess`: ``[("Answer: 15876", True)]``. The end-of-turn token
    that follows is the caller's.
    """
    from torchtune_grpo.datasets.multiplication import MULTIPLICATION_ANSWER_PHRASE
    from torchtune_grpo.rollout.tools import Calculator, ToolCallSyntax

    if not use_tool:
        return [(f"{MULTIPLICATION_ANSWER_PHRASE} {direct_guess(answer, rng)}", True)]
    expression = question.removeprefix("What is ").removesuffix("?")
    syntax, name = ToolCallSyntax(), Calculator().name
    return [(syntax.format_call(name, expression), True),
            (syntax.format_result(answer), False),
            (f"{MULTIPLICATION_ANSWER_PHRASE} {answer}", True)]


def copy_drills(tokenizer, problems, rng: random.Random, *, answer_drills: int,
                call_drills: int) -> list[tuple[list[int], list[tuple[list[int], float]]]]:
    """Copy exercises for the tool warm-up, as ``(prompt ids, segments)`` like a demonstration.

    They teach the two copies a tool call needs without touching the decision to call:

    - ``answer_drills`` result -> answer drills: after BOS only (no question), the tool's text
      ``<result>N</result>`` (context, weight 0) and the trained ``Answer: N`` and end-of-turn
      token, where ``N`` is a random 4- or 5-digit number, not a product: the answer can only
      be copied, never estimated from operands;
    - ``call_drills`` operands -> call drills: a ``warmup`` question and its call
      ``<calculator>37*412</calculator>``, whose first token (the choice to call) has weight 0.

    No drill trains the token that follows a question's prompt, so the model's prior for
    calling the tool is set by the demonstrations alone (``tool_fraction``).
    """
    from torchtune_grpo.datasets.multiplication import MULTIPLICATION_ANSWER_PHRASE
    from torchtune_grpo.rollout.tools import Calculator, ToolCallSyntax

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
        out.append((_encode_prompt(tokenizer, question), [(call[:1], 0.0), (call[1:], 1.0)]))
    return out


def tool_warmup(model, tokenizer, problems, *, steps: int,
                batch_size: int = TOOL_WARMUP_BATCH_SIZE,
                lr: float = TOOL_WARMUP_LR, tool_fraction: float = TOOL_FRACTION,
                tool_weight: float = TOOL_WEIGHT, answer_drills: int = TOOL_ANSWER_DRILLS,
                call_drills: int = TOOL_CALL_DRILLS, seed: int = 0) -> None:
    """Teacher-forced warm-up on multiplication demonstrations, a minority with the tool.

    Each sampled problem is shown calling the calculator with probability ``tool_fraction``
    (:func:`tool_demonstration`) and answering directly with a plausible wrong guess
    otherwise; the loss covers the model's text (the call, the final answer and the
    end-of-turn token), never the tool's result.

    ``tool_weight`` scales the loss of a tool demonstration's tokens **after its first one**:
    the first token (``<`` of the call, or ``A`` of a direct answer) keeps weight 1, so the
    model's prior for calling the tool stays about ``tool_fraction``, while copying the
    operands into the call and the result into the answer, which only the tool
    demonstrations teach, is learned in fewer steps.

    Each batch also holds ``answer_drills`` + ``call_drills`` copy exercises
    (:func:`copy_drills`) that never train the choice to call the tool; the learning rate
    decays to 0 along a half cosine. Without the drills the copy of the result into the
    answer is learned slowly and, depending on the seed, only part of the time
    (docs/quickstart_tools.md).
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
        return _encode_prompt(tokenizer, question), out

    def drills():
        return copy_drills(tokenizer, problems, rng, answer_drills=answer_drills,
                           call_drills=call_drills)

    _train_on_demonstrations(model, tokenizer, demonstrate, steps=steps, batch_size=batch_size,
                             lr=lr, group_by_length=True,
                             drills=drills if answer_drills or call_drills else None,
                             cosine=True)


def prepare_quickstart(output_dir: str | Path = DEFAULT_QUICKSTART_DIR, *,
                       warmup_steps: int = WARMUP_STEPS, seed: int = 0,
                       correct_fraction: float = CORRECT_FRACTION) -> Path:
    """Write the quickstart's starting model (HF safetensors) and tokenizer into ``output_dir``.

    Deterministic for a given ``seed`` (and thread count).

    Args:
        output_dir: folder the ``grpo/quickstart_cpu`` config reads (``checkpointer`` and
            ``tokenizer`` paths).
        warmup_steps: supervised warm-up steps on the ``warmup`` split (0: random weights).
        seed: seed of the initial weights and the warm-up.
        correct_fraction: share of warm-up demonstrations that show the right answer.

    Returns:
        ``output_dir``.
    """
    torch.manual_seed(seed)
    output_dir = Path(output_dir)
    tokenizer = tiny_tokenizer(output_dir)
    model = tiny_llama(**QUICKSTART_MODEL_DIMS)
    if warmup_steps:
        supervised_warmup(model, tokenizer, addition_problems("warmup"), steps=warmup_steps,
                          correct_fraction=correct_fraction, seed=seed)
    return write_hf_checkpoint(model, output_dir, QUICKSTART_MODEL_DIMS)


def prepare_tools_quickstart(output_dir: str | Path = DEFAULT_TOOLS_QUICKSTART_DIR, *,
                             warmup_steps: int = TOOL_WARMUP_STEPS, seed: int = 0,
                             tool_fraction: float = TOOL_FRACTION,
                             tool_weight: float = TOOL_WEIGHT) -> Path:
    """Write the tool quickstart's starting model and tokenizer into ``output_dir``.

    The same tiny model as :func:`prepare_quickstart`, warmed up by :func:`tool_warmup` on the
    multiplication ``warmup`` split: a minority (``tool_fraction``) of demonstrations call the
    calculator, the rest answer with a plausible wrong guess. Deterministic for a given
    ``seed`` (and thread count).

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


def main(argv: list[str] | None = None) -> None:
    """``tune-grpo prepare-quickstart``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="tune-grpo prepare-quickstart",
                                     description=prepare_quickstart.__doc__)
    parser.add_argument("--tools", action="store_true",
                        help="the tool quickstart (grpo/quickstart_cpu_tools): multiplication, "
                             "a warm-up that calls the calculator in a minority of "
                             "demonstrations; with --evaluate: evaluate on that task")
    parser.add_argument("--output-dir", default=None,
                        help=f"default {DEFAULT_QUICKSTART_DIR} "
                             f"(with --tools: {DEFAULT_TOOLS_QUICKSTART_DIR})")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help=f"default {WARMUP_STEPS} (with --tools: {TOOL_WARMUP_STEPS})")
    parser.add_argument("--correct-fraction", type=float, default=CORRECT_FRACTION)
    parser.add_argument("--tool-fraction", type=float, default=TOOL_FRACTION,
                        help="with --tools: share of warm-up demonstrations that call the tool")
    parser.add_argument("--tool-weight", type=float, default=TOOL_WEIGHT,
                        help="with --tools: loss weight of a tool demonstration's tokens after "
                             "its first one")
    parser.add_argument("--no-tool-results", action="store_true",
                        help="with --tools --evaluate: the calculator disabled (calls get no "
                             "result), as in the negative control")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true",
                        help="rewrite an existing model folder (default: keep it)")
    parser.add_argument("--evaluate", nargs="+", metavar="CHECKPOINT_DIR",
                        help="print the held-out greedy success of these checkpoints and exit")
    args = parser.parse_args(argv)
    if args.evaluate:
        for directory in args.evaluate:
            if args.tools:
                success, calls = tool_heldout_success(directory, tools=not args.no_tool_results)
                print(f"{directory}: held-out greedy success {success:.3f}, "
                      f"tool calls per completion {calls:.3f}")
            else:
                print(f"{directory}: held-out greedy success {heldout_success(directory):.3f}")
        return
    if args.tools:
        target = Path(args.output_dir or DEFAULT_TOOLS_QUICKSTART_DIR)
        if (target / "model.safetensors").is_file() and not args.overwrite:
            print(f"{target} already holds a tool quickstart model: kept (pass --overwrite to "
                  "write a new one)")
            return
        path = prepare_tools_quickstart(
            args.output_dir or DEFAULT_TOOLS_QUICKSTART_DIR,
            warmup_steps=TOOL_WARMUP_STEPS if args.warmup_steps is None else args.warmup_steps,
            seed=args.seed, tool_fraction=args.tool_fraction, tool_weight=args.tool_weight)
        success, calls = tool_heldout_success(path)
        print(f"tool quickstart model and tokenizer written to {path}")
        print(f"held-out greedy success of this starting model: {success:.3f} "
              f"(tool calls per completion {calls:.3f})")
        return
    target = Path(args.output_dir or DEFAULT_QUICKSTART_DIR)
    if (target / "model.safetensors").is_file() and not args.overwrite:
        print(f"{target} already holds a quickstart model: kept (pass --overwrite to write a "
              "new one)")
        return
    path = prepare_quickstart(target,
                              warmup_steps=WARMUP_STEPS if args.warmup_steps is None
                              else args.warmup_steps,
                              seed=args.seed, correct_fraction=args.correct_fraction)
    print(f"quickstart model and tokenizer written to {path}")
    print(f"held-out greedy success of this starting model: {heldout_success(path):.3f}")


if __name__ == "__main__":
    main()
