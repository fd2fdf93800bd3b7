"""The CPU quickstart: the addition task, a tiny model and its starting weights, made locally.

:func:`prepare_quickstart` warms the tiny model up on noisy demonstrations of the ``warmup``
split (a ``correct_fraction`` show the right sum, the rest echo the first operand), so sampling
is sometimes right while greedy decoding mostly echoes; ``docs/quickstart.md`` explains why.
Also shared with the tool quickstart: the model's dimensions, :func:`load_quickstart_model` and
:func:`train_on_demonstrations`.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtune_grpo.datasets.addition import addition_problems
from torchtune_grpo.quickstart.tiny import (
    TINY_MODEL_DIMS,
    tiny_llama,
    tiny_tokenizer,
    write_hf_checkpoint,
)

#: Where the shipped ``grpo/quickstart_cpu`` config looks for the model.
DEFAULT_QUICKSTART_DIR = "/tmp/tune_grpo_quickstart/base"
#: Builder arguments of the quickstart model (must match ``model`` in ``grpo/quickstart_cpu``).
QUICKSTART_MODEL_DIMS = dict(TINY_MODEL_DIMS)
#: Warm-up defaults: optimizer steps, batch size, learning rate, share of correct demonstrations.
WARMUP_STEPS = 500
WARMUP_BATCH_SIZE = 64
WARMUP_LR = 3e-3
CORRECT_FRACTION = 0.3


def encode_prompt(tokenizer, question: str) -> list[int]:
    """Prompt ids of a plain-text question: BOS, then the text (no template, no EOS)."""
    return tokenizer.encode(question, add_bos=True, add_eos=False)


def echo_answer(question: str) -> str:
    """The wrong demonstration: the first operand (``"3812+1111="`` -> ``"3812"``)."""
    return question.split("+", 1)[0]


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
    prompts = [encode_prompt(tokenizer, q) for q in questions]
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


def train_on_demonstrations(model, tokenizer, demonstrate, *, steps: int, batch_size: int,
                             lr: float, group_by_length: bool = False, drills=None,
                             cosine: bool = False, report_every_s: float | None = None) -> None:
    """Teacher-forced cross-entropy: ``demonstrate()`` gives ``(prompt ids, segments)``.

    ``segments`` are ``(token ids, weight)``; the loss is the weighted mean over tokens of non-zero
    weight (never the prompt or a tool's result). ``group_by_length`` runs one forward per distinct
    length; ``drills()`` adds more ``(prompt ids, segments)`` to each batch; ``cosine`` decays the
    learning rate to 0 along a half cosine; ``report_every_s`` prints progress that often.
    """
    start = last = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1.0 + math.cos(math.pi * s / steps))) if cosine else None
    for step in range(steps):
        if report_every_s is not None and time.perf_counter() - last >= report_every_s:
            last = time.perf_counter()
            print(f"warm-up: step {step}/{steps} ({last - start:.0f} s)", flush=True)
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
                      correct_fraction: float = CORRECT_FRACTION, seed: int = 0,
                      report_every_s: float | None = None) -> None:
    """Teacher-forced cross-entropy on ``problems``, each shown with its right answer with
    probability ``correct_fraction`` and with :func:`echo_answer` otherwise (loss on the answer and
    end-of-turn tokens; ``report_every_s``: a progress line that often).
    """
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"correct_fraction must be in [0, 1], got {correct_fraction}")
    rng = random.Random(seed)
    eot = tokenizer.eot_id

    def demonstrate():
        question, answer = problems[rng.randrange(len(problems))]
        shown = answer if rng.random() < correct_fraction else echo_answer(question)
        target = tokenizer.encode(shown, add_bos=False, add_eos=False) + [eot]
        return encode_prompt(tokenizer, question), [(target, True)]

    train_on_demonstrations(model, tokenizer, demonstrate, steps=steps, batch_size=batch_size,
                             lr=lr, report_every_s=report_every_s)


def prepare_quickstart(output_dir: str | Path = DEFAULT_QUICKSTART_DIR, *,
                       warmup_steps: int = WARMUP_STEPS, seed: int = 0,
                       correct_fraction: float = CORRECT_FRACTION,
                       report_every_s: float | None = None) -> Path:
    """Write the quickstart's starting model (HF safetensors) and tokenizer into ``output_dir``;
    deterministic for a given ``seed`` and thread count.

    Args:
        output_dir: folder the ``grpo/quickstart_cpu`` config reads.
        warmup_steps: supervised warm-up steps on the ``warmup`` split (0: random weights).
        seed: seed of the initial weights and the warm-up.
        correct_fraction: share of warm-up demonstrations that show the right answer.
        report_every_s: print the warm-up's progress that often (None: silent).

    Returns:
        ``output_dir``.
    """
    torch.manual_seed(seed)
    output_dir = Path(output_dir)
    tokenizer = tiny_tokenizer(output_dir)
    model = tiny_llama(**QUICKSTART_MODEL_DIMS)
    if warmup_steps:
        supervised_warmup(model, tokenizer, addition_problems("warmup"), steps=warmup_steps,
                          correct_fraction=correct_fraction, seed=seed,
                          report_every_s=report_every_s)
    return write_hf_checkpoint(model, output_dir, QUICKSTART_MODEL_DIMS)
