"""The CPU quickstart: a task, a tiny model and its starting weights, made locally.

The task is two-number addition written as text (``"37+45="`` -> ``"82"``): every prompt needs
its own answer (no constant output scores), answers are checked exactly by the same numeric
reward GSM8K uses, and problems split into disjoint train and held-out sets.

A randomly initialised model never answers correctly, so its groups would have no reward
variance and GRPO would have nothing to learn from. ``prepare`` therefore gives the tiny
model a short supervised warm-up on a *separate* slice of problems (a few seconds on two
cores) that leaves it well short of mastery: it answers some problems and misses most, which
is the regime GRPO is for (an SFT-then-RL pipeline in miniature).

Command::

    tune-grpo prepare-quickstart [--output-dir DIR] [--warmup-steps N] [--seed S]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtune_grpo.datasets.addition import addition_problems
from torchtune_grpo.tiny import TINY_MODEL_DIMS, tiny_llama, tiny_tokenizer, write_hf_checkpoint

#: Where the shipped ``grpo/quickstart_cpu`` config looks for the model.
DEFAULT_QUICKSTART_DIR = "/tmp/torchtune_grpo/quickstart/base"
def _encode_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(question, add_bos=True, add_eos=False)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[tuple[str, str]], max_new: int = 4) -> float:
    """Exact-match accuracy of greedy decoding (no KV cache; for small problem sets)."""
    model.eval()
    correct = 0
    for question, answer in problems:
        ids = _encode_prompt(tokenizer, question)
        for _ in range(max_new):
            logits = model(torch.tensor([ids]))[0, -1, : tokenizer.vocab_size]
            nxt = int(logits.argmax())
            if nxt in tokenizer.stop_tokens:
                break
            ids.append(nxt)
        text = tokenizer.decode(ids[len(_encode_prompt(tokenizer, question)) :])
        correct += int(text.strip() == answer)
    model.train()
    return correct / max(len(problems), 1)


def supervised_warmup(model, tokenizer, problems, *, steps: int, batch_size: int = 64,
                      lr: float = 3e-3, seed: int = 0) -> None:
    """Teacher-forced cross-entropy on the answer tokens (and the end-of-turn token)."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eot = tokenizer.eot_id
    for _ in range(steps):
        batch = [problems[rng.randrange(len(problems))] for _ in range(batch_size)]
        seqs, masks = [], []
        for question, answer in batch:
            prompt = _encode_prompt(tokenizer, question)
            target = tokenizer.encode(answer, add_bos=False, add_eos=False) + [eot]
            seqs.append(prompt + target)
            masks.append([0] * len(prompt) + [1] * len(target))
        width = max(map(len, seqs))
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        weight = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        loss = (loss * weight[:, 1:].flatten()).sum() / weight[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def prepare_quickstart(output_dir: str | Path = DEFAULT_QUICKSTART_DIR, *, warmup_steps: int = 150,
                       seed: int = 0) -> Path:
    """Write the quickstart's starting model (HF safetensors) and tokenizer into ``output_dir``.

    Args:
        output_dir: folder the ``grpo/quickstart_cpu`` config reads (``checkpointer`` and
            ``tokenizer`` paths).
        warmup_steps: supervised warm-up steps on the ``warmup`` split (0: random weights).
        seed: seed of the initial weights and the warm-up.

    Returns:
        ``output_dir``.
    """
    torch.manual_seed(seed)
    output_dir = Path(output_dir)
    tokenizer = tiny_tokenizer(output_dir)
    model = tiny_llama()
    if warmup_steps:
        supervised_warmup(model, tokenizer, addition_problems("warmup"), steps=warmup_steps,
                          seed=seed)
    return write_hf_checkpoint(model, output_dir, TINY_MODEL_DIMS)


def main(argv: list[str] | None = None) -> None:
    """``tune-grpo prepare-quickstart``: see the module docstring."""
    parser = argparse.ArgumentParser(prog="tune-grpo prepare-quickstart",
                                     description=prepare_quickstart.__doc__)
    parser.add_argument("--output-dir", default=DEFAULT_QUICKSTART_DIR)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = prepare_quickstart(args.output_dir, warmup_steps=args.warmup_steps, seed=args.seed)
    print(f"quickstart model and tokenizer written to {path}")


if __name__ == "__main__":
    main()
