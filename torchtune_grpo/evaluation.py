"""Evaluation of a policy on a whole test split: pass@1, pass@k, maj@k, reward means.

Used by ``tune run grpo_eval`` (a checkpoint on disk) and by the training recipe every
``eval_every_n_steps`` (the live model). Both write the same two files into the checkpoint
folder they describe:

* ``eval_results.json``: dataset, split, number of problems, metrics, sampling settings, model
  path, timestamp;
* ``eval_samples.jsonl``: one line per problem with its prompt, completions, extracted answers,
  gold answer and per-sample correctness.

With several ranks the problems are split across ranks (each rank runs the same number of
generation micro-batches, padding its share with a repeat that is then dropped, so FSDP's
collectives stay in lockstep) and the results are gathered on every rank.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtune_grpo import distributed as D
from torchtune_grpo.config import sampling_problems
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.rlhf.generation import decode_completions, generate_trajectory, mix_seeds

RESULTS_FILE = "eval_results.json"
SAMPLES_FILE = "eval_samples.jsonl"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``1 - C(n - c, k) / C(n, k)``.

    Args:
        n: samples drawn.
        c: correct samples among them.
        k: budget (``k <= n``).
    """
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must lie in [0, n={n}]")
    if n - c < k:
        return 1.0
    # prod_{i = n-c+1}^{n} (1 - k / i), the numerically stable form of the ratio
    result = 1.0
    for i in range(n - c + 1, n + 1):
        result *= 1.0 - k / i
    return 1.0 - result


def majority_correct(answers: Sequence[Any], correct: Sequence[bool], k: int) -> bool:
    """maj@k of one problem: is the most frequent extracted answer of the first ``k`` right?

    Samples without an extracted answer (``None``) do not vote; ties go to the answer seen
    first; no votes at all counts as wrong.
    """
    votes = [(a, c) for a, c in zip(answers[:k], correct[:k]) if a is not None]
    if not votes:
        return False
    counts = Counter(a for a, _ in votes)
    best = max(counts.values())
    winner = next(a for a, _ in votes if counts[a] == best)
    return next(c for a, c in votes if a == winner)


def _answer_key(extract, completion: str) -> Any:
    if extract is None:
        text = completion.strip()
        return text or None
    value = extract(completion)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@dataclass
class EvalSettings:
    """How to sample during evaluation.

    Attributes:
        num_samples: completions per problem (1 with ``temperature: 0`` is greedy pass@1).
        temperature: 0 for greedy decoding.
        top_k: top-k sampling (None: off).
        k: budgets reported as ``pass@k`` and ``maj@k`` (each ``<= num_samples``).
        max_generated_tokens: generation budget per completion.
        forward_batch_size: sequences per generation micro-batch.
        seed: base seed of the per-sample random numbers.
    """

    num_samples: int = 1
    temperature: float = 0.0
    top_k: int | None = None
    k: list[int] = field(default_factory=lambda: [1])
    max_generated_tokens: int = 256
    forward_batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        problems = sampling_problems(self.num_samples, self.temperature, self.k)
        if problems:
            raise ValueError("eval " + "; ".join(problems.values()))


@dataclass
class EvalResult:
    """Metrics (``pass@1``, ``pass@k``, ``maj@k``, ``reward/<name>``, ...) and per-problem rows."""

    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    settings: EvalSettings
    seconds: float

    def summary(self, **info: Any) -> dict[str, Any]:
        """The ``eval_results.json`` payload; ``info`` adds dataset, split, model path..."""
        return {
            **info,
            "num_problems": len(self.samples),
            "metrics": self.metrics,
            "sampling": self.settings.__dict__,
            "seconds": self.seconds,
            "problems_per_second": len(self.samples) / max(self.seconds, 1e-9),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def files(self, **info: Any) -> dict[str, str]:
        """``{eval_results.json: ..., eval_samples.jsonl: ...}`` as text."""
        return {
            RESULTS_FILE: json.dumps(self.summary(**info), indent=2) + "\n",
            SAMPLES_FILE: "".join(json.dumps(row) + "\n" for row in self.samples),
        }

    def write(self, directory: str | Path, **info: Any) -> list[Path]:
        """Write ``eval_results.json`` and ``eval_samples.jsonl`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in self.files(**info).items():
            (directory / name).write_text(text)
            paths.append(directory / name)
        return paths


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    rewards: Any,
    settings: EvalSettings,
    *,
    device: torch.device,
    logit_bias: torch.Tensor,
    allowed_tokens: torch.Tensor,
    stop_tokens: torch.Tensor,
    pad_id: int,
    cache_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> EvalResult:
    """Evaluate ``model`` on every problem of ``dataset`` (a :class:`PromptDataset`).

    Call on every rank of a distributed run; each rank gets the full result.

    Args:
        model: the policy (plain or FSDP-sharded torchtune decoder).
        tokenizer: its tokenizer.
        dataset: the problems.
        rewards: a :class:`~torchtune_grpo.rlhf.rewards.RewardSet`; its success component
            decides correctness (and, when it has ``extract_answer``, the votes of maj@k).
        settings: sampling settings.
        device: where the model runs.
        logit_bias: ``[V]`` bias forbidding undefined ids.
        allowed_tokens: ``[V]`` bool, ids that may be decoded.
        stop_tokens: ``[s]`` stop ids.
        pad_id: padding id.
        cache_dtype: KV-cache dtype.
        progress: show a tqdm bar (rank 0).
    """
    from tqdm import tqdm

    start = time.perf_counter()
    world, rank = D.world_size(), D.rank()
    total = len(dataset)
    mine = list(range(rank, total, world))
    per_rank = math.ceil(total / world)
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    success_fn = next(e.fn for e in rewards.entries if e.name == rewards.success_name)
    extract = getattr(success_fn, "extract_answer", None)
    n = settings.num_samples
    prompts_per_batch = max(1, settings.forward_batch_size // n)
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=per_rank, disable=not (progress and rank == 0), desc="eval")
    for offset in range(0, per_rank, prompts_per_batch):
        chunk = padded[offset : offset + prompts_per_batch]
        items = [dataset[i] for i in chunk]
        batch = collate_prompts(items, pad_id=pad_id)
        tokens = batch["tokens"].to(device)
        lengths = batch["prompt_lengths"].to(device)
        prompt_mask = torch.arange(tokens.shape[1], device=device)[None, :] >= (
            tokens.shape[1] - lengths[:, None]
        )
        traj = generate_trajectory(
            model, tokens, prompt_mask, group_size=n,
            forward_batch_size=min(settings.forward_batch_size, len(chunk) * n),
            prompt_seeds=mix_seeds(settings.seed, batch["indices"]),
            max_generated_tokens=settings.max_generated_tokens,
            temperature=settings.temperature, top_k=settings.top_k, stop_tokens=stop_tokens,
            pad_id=pad_id, logit_bias=logit_bias,
            all_done=lambda done: D.all_ranks_true(done, device), cache_dtype=cache_dtype,
        )
        completions = decode_completions(tokenizer, traj, allowed_tokens)
        answers = [a for a in batch["answers"] for _ in range(n)]
        scored = rewards(
            completions, answers,
            questions=[q for q in batch["questions"] for _ in range(n)],
            stopped=traj.stopped.tolist(), response_lengths=traj.response_lengths.tolist(),
            max_generated_tokens=settings.max_generated_tokens,
        )
        for j, dataset_index in enumerate(chunk):
            if offset + j >= len(mine):
                continue  # lockstep padding
            sl = slice(j * n, (j + 1) * n)
            texts = completions[sl]
            rows.append({
                "index": int(batch["indices"][j]),
                "position": dataset_index,
                "question": batch["questions"][j],
                "prompt": tokenizer.decode(items[j]["tokens"], skip_special_tokens=False)
                if hasattr(tokenizer, "decode") else None,
                "gold": batch["answers"][j],
                "completions": texts,
                "extracted": [_answer_key(extract, t) for t in texts],
                "correct": [bool(x) for x in scored.success[sl].tolist()],
                "rewards": {k: v[sl].tolist() for k, v in scored.components.items()},
            })
        bar.update(len(chunk))
    bar.close()
    if was_training:
        model.train()

    if world > 1:
        gathered: list[list[dict]] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, rows)
        rows = [r for part in gathered for r in part]
    rows.sort(key=lambda r: r["position"])
    metrics = _metrics(rows, settings)
    return EvalResult(metrics=metrics, samples=rows, settings=settings,
                      seconds=time.perf_counter() - start)


def _metrics(rows: list[dict[str, Any]], settings: EvalSettings) -> dict[str, float]:
    if not rows:
        return {}
    n = settings.num_samples
    metrics: dict[str, float] = {}
    for k in sorted(set(settings.k) | {1}):
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(r["correct"]), k) for r in rows) / len(rows)
        if k > 1:
            metrics[f"maj@{k}"] = sum(
                majority_correct(r["extracted"], r["correct"], k) for r in rows
            ) / len(rows)
    for name in rows[0]["rewards"]:
        values = [v for r in rows for v in r["rewards"][name]]
        metrics[f"reward/{name}"] = sum(values) / len(values)
    metrics["response_chars/mean"] = sum(len(c) for r in rows for c in r["completions"]) / (
        len(rows) * n
    )
    return metrics
