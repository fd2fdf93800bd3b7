"""Evaluation of a policy on a whole test split: pass@1, pass@k, maj@k, reward means.

Used by ``tune run grpo_eval`` (a checkpoint on disk) and by the training recipe every
``eval_every_n_steps`` (the live model). Both write the same two files into the checkpoint
folder they describe:

* ``eval_results.json``: dataset, split, number of problems, metrics, sampling settings, model
  path, timestamp;
* ``eval_samples.jsonl``: one line per problem with its prompt, completions, extracted answers,
  gold answer and per-sample correctness; with tools, also each completion's ``transcripts``:
  its text as ``{"source": "model" | "tool", "text": ...}`` segments, so the tool results are
  marked.

With tools (``tool_generator``: a :class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`) the
evaluation runs the same multi-turn rollout as training, and a completion's text (what the
rewards read) is the model's and the tools' tokens in order.

Finished work is never lost: given ``partial_dir``, :func:`evaluate` appends each problem's row
to ``eval_samples.rank{r}.partial.jsonl`` (one file per rank, flushed) as soon as it is scored,
so a crash later on (in a metric, in serialising the results, in writing them) leaves every
completed sample on disk, and the error names those files. :meth:`EvalResult.write` replaces
both result files atomically (temporary file, then rename) and only then removes the partial
files.

With several ranks the problems are split across ranks (each rank runs the same number of
generation micro-batches, padding its share with a repeat that is then dropped, so FSDP's
collectives stay in lockstep) and the results are gathered on every rank.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from torchtune_grpo.training import distributed as D
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.evaluation.stats import wilson_interval
from torchtune_grpo.rollout.native import (
    generate_trajectory,
    safe_decode,
)
from torchtune_grpo.rewards.scoring import score_rollout
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.algorithm.trajectory import prompt_mask
from torchtune_grpo.training.settings import EvalSettings

RESULTS_FILE = "eval_results.json"
SAMPLES_FILE = "eval_samples.jsonl"
#: Per-rank file that :func:`evaluate` appends each scored problem to (``{rank}``: the rank).
PARTIAL_SAMPLES_FILE = "eval_samples.rank{rank}.partial.jsonl"


#: Keys of a training config that make its evaluation multi-turn (see
#: :func:`tool_settings_from_checkpoint`).
TOOL_KEYS = ("tools", "max_tool_calls", "tool_syntax")


def tool_settings_from_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The ``tools``, ``max_tool_calls`` and ``tool_syntax`` a step folder was trained with.

    Read from the training config saved in its ``recipe_state.pt`` (memory-mapped, so its
    optimizer state is not read). A folder without that file (a downloaded model), or one
    trained without tools, gives ``{"tools": None}``.

    Args:
        checkpoint_dir: a ``step_{N}`` folder.

    Returns:
        ``{"tools": [...] | None, ...}``: only the keys the training config had.
    """
    from omegaconf import OmegaConf

    from torchtune_grpo.training.checkpointing import RECIPE_STATE_FILE

    path = Path(str(checkpoint_dir)) / RECIPE_STATE_FILE
    if not path.is_file():
        return {"tools": None}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    config = state.get("config") or {}
    found = {k: config[k] for k in TOOL_KEYS if config.get(k) is not None}
    found.setdefault("tools", None)
    return {k: (OmegaConf.create(v) if isinstance(v, (list, dict)) else v)
            for k, v in found.items()}


def partial_samples_path(directory: str | Path, rank: int) -> Path:
    """Where rank ``rank`` appends its scored problems while evaluating into ``directory``."""
    return Path(directory) / PARTIAL_SAMPLES_FILE.format(rank=rank)


def _takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn``'s signature names the parameter ``name`` (``**kwargs`` does not count)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and other callables without a signature
        return False
    param = params.get(name)
    return param is not None and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    )


def decode_prompt(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of a prompt, special tokens (chat headers, BOS) kept where the tokenizer can.

    Tokenizers whose ``decode`` takes ``skip_special_tokens`` (torchtune's Llama 3 and Qwen 2
    tokenizers) are asked to keep them; others (torchtune's ``HuggingFaceBaseTokenizer``, a
    ``decode`` without keywords) decode as they do by default. Never raises: when decoding
    fails (undefined ids, no ``decode`` at all) it falls back to
    :func:`~torchtune_grpo.rollout.native.safe_decode`, which skips what it cannot decode.

    Args:
        tokenizer: any tokenizer of the project.
        token_ids: ``[P]`` prompt ids.

    Returns:
        The decoded prompt ("" when nothing decodes).
    """
    ids = [int(i) for i in token_ids]
    decode = getattr(tokenizer, "decode", None)
    if decode is not None and _takes_keyword(decode, "skip_special_tokens"):

        def keep_specials(some: list[int]) -> str:
            text = decode(some, skip_special_tokens=False)
            if not isinstance(text, str):
                raise TypeError(f"decode returned {type(text).__name__}")
            return text

        try:
            return keep_specials(ids)
        except Exception:  # noqa: BLE001 - some id does not decode: drop those, keep the rest
            pass
        try:
            return keep_specials([i for i in ids if _decodes_alone(keep_specials, i)])
        except Exception:  # noqa: BLE001 - fall back to the decoder that never raises
            pass
    try:
        return safe_decode(tokenizer, ids)
    except Exception:  # noqa: BLE001 - a row without its prompt text beats a lost evaluation
        return ""


def _decodes_alone(decode: Any, token_id: int) -> bool:
    """Whether ``decode([token_id])`` succeeds."""
    try:
        decode([token_id])
        return True
    except Exception:  # noqa: BLE001 - any failure means "not decodable"
        return False


def _plain(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: tensors/arrays as lists, mapping keys
    as strings, any other object as its ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    return str(value)


class _PartialSamples:
    """This rank's ``eval_samples.rank{r}.partial.jsonl``: one flushed line per scored problem.

    Rows go through :func:`_plain` first (values JSON cannot hold become text), so a row that
    breaks the final, strict ``eval_samples.jsonl`` still reaches this file.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w", encoding="utf-8")  # a rerun starts the file afresh

    def append(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_plain(row)) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _where_partial(paths: Sequence[Path]) -> str:
    """The sentence an error ends with: where the completed samples are (or that none are)."""
    if not paths:
        return "no partial samples were kept (pass `partial_dir` to evaluate() to keep them)"
    return "the completed samples are in " + ", ".join(str(p) for p in paths)


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
class EvalResult:
    """Metrics (``pass@1``, ``pass@k``, ``maj@k``, ``reward/<name>``, ...) and per-problem rows.

    Attributes:
        metrics: metric name to value.
        samples: one row per problem, in dataset order.
        settings: the sampling settings used.
        seconds: wall time of the evaluation.
        partial_files: the per-rank ``eval_samples.rank{r}.partial.jsonl`` files holding the
            same rows (empty when :func:`evaluate` ran without ``partial_dir``);
            :meth:`write` removes them once the final files are in place.
    """

    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    settings: EvalSettings
    seconds: float
    partial_files: list[Path] = field(default_factory=list)

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
        """``{eval_results.json: ..., eval_samples.jsonl: ...}`` as text.

        Raises:
            ValueError: a row or the summary holds a value JSON cannot represent; the message
                names the row and where the partial samples are.
        """
        lines = []
        for row in self.samples:
            try:
                lines.append(json.dumps(row) + "\n")
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"eval: the row of problem index={row.get('index')} "
                    f"(position {row.get('position')}) cannot be written as JSON ({exc}); check "
                    f"what the dataset and the rewards return; {_where_partial(self.partial_files)}"
                ) from exc
        try:
            results = json.dumps(self.summary(**info), indent=2) + "\n"
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"eval: {RESULTS_FILE} cannot be written as JSON ({exc}); "
                f"{_where_partial(self.partial_files)}"
            ) from exc
        return {RESULTS_FILE: results, SAMPLES_FILE: "".join(lines)}

    def write(self, directory: str | Path, **info: Any) -> list[Path]:
        """Write ``eval_results.json`` and ``eval_samples.jsonl`` into ``directory``, atomically.

        Both texts are built first, written to temporary files in ``directory`` and renamed over
        the final names (samples first, so a present ``eval_results.json`` always has its
        samples); only then are :attr:`partial_files` removed. On any failure the partial files
        stay and the error says where they are.

        Args:
            directory: the folder to write into (created if needed).
            **info: extra fields of ``eval_results.json`` (dataset, split, model path...).

        Returns:
            ``[eval_results.json, eval_samples.jsonl]`` paths.
        """
        directory = Path(directory)
        texts = self.files(**info)
        written: dict[str, Path] = {}
        temps: list[Path] = []
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name in (SAMPLES_FILE, RESULTS_FILE):
                tmp = directory / f".{name}.{os.getpid()}.tmp"
                temps.append(tmp)
                with tmp.open("w", encoding="utf-8") as f:
                    f.write(texts[name])
                    f.flush()
                    os.fsync(f.fileno())
            for name, tmp in zip((SAMPLES_FILE, RESULTS_FILE), temps):
                os.replace(tmp, directory / name)
                written[name] = directory / name
        except OSError as exc:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            raise OSError(
                f"eval: writing {RESULTS_FILE} / {SAMPLES_FILE} into {directory} failed ({exc}); "
                f"{_where_partial(self.partial_files)}"
            ) from exc
        self.remove_partial_files()
        return [written[RESULTS_FILE], written[SAMPLES_FILE]]

    def remove_partial_files(self) -> None:
        """Delete the per-rank partial sample files that this process can see."""
        for path in self.partial_files:
            path.unlink(missing_ok=True)


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
    partial_dir: str | Path | None = None,
    gather_weights: bool = True,
    tool_generator: Any = None,
) -> EvalResult:
    """Evaluate ``model`` on every problem of ``dataset`` (a :class:`PromptDataset`).

    Call on every rank of a distributed run; each rank gets the full result.

    Args:
        model: the policy (plain or FSDP-sharded torchtune decoder).
        tokenizer: its tokenizer.
        dataset: the problems.
        rewards: a :class:`~torchtune_grpo.rewards.reward_set.RewardSet`; its success component
            decides correctness (and, when it has ``extract_answer``, the votes of maj@k).
        settings: sampling settings.
        device: where the model runs.
        logit_bias: ``[V]`` bias forbidding undefined ids.
        allowed_tokens: ``[V]`` bool, ids that may be decoded.
        stop_tokens: ``[s]`` stop ids.
        pad_id: padding id.
        cache_dtype: KV-cache dtype.
        progress: show a tqdm bar (rank 0).
        partial_dir: when given, each rank appends every problem's row, as soon as it is
            scored, to ``partial_dir/eval_samples.rank{r}.partial.jsonl`` (flushed), so a later
            failure loses no finished work; :meth:`EvalResult.write` removes these files after
            writing the final ones. ``None``: rows are kept in memory only.
        gather_weights: hold an FSDP2 model's full weights for the whole evaluation
            (:func:`~torchtune_grpo.training.distributed.gathered_for_inference`) instead of gathering
            them on every decode step; no effect on an unsharded model.
        tool_generator: a :class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator` whose
            tools run between turns (its inner engine must sample with ``model``, as
            :class:`~torchtune_grpo.rollout.native.NativeGenerator` does); None: single-turn
            :func:`~torchtune_grpo.rollout.native.generate_trajectory`. With it, every row
            holds ``transcripts`` and the metrics add ``tools/calls_per_completion`` and
            ``tools/errors``.

    Raises:
        RuntimeError: computing the metrics failed; the message says where the partial
            samples are.
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
    partial_files = (
        [partial_samples_path(partial_dir, r) for r in range(world)] if partial_dir else []
    )
    partial = _PartialSamples(partial_files[rank] if partial_files else None)
    bar = tqdm(total=per_rank, disable=not (progress and rank == 0), desc="eval")
    try:
        with D.gathered_for_inference(model, enabled=gather_weights):
            for offset in range(0, per_rank, prompts_per_batch):
                chunk = padded[offset : offset + prompts_per_batch]
                rows.extend(_evaluate_chunk(
                    model, tokenizer, dataset, rewards, settings, chunk,
                    num_real=max(0, min(len(chunk), len(mine) - offset)), extract=extract,
                    partial=partial, device=device, logit_bias=logit_bias,
                    allowed_tokens=allowed_tokens, stop_tokens=stop_tokens, pad_id=pad_id,
                    cache_dtype=cache_dtype, tool_generator=tool_generator,
                ))
                bar.update(len(chunk))
    finally:
        partial.close()
        bar.close()
        if was_training:
            model.train()

    if world > 1:
        rows = [r for part in D.all_gather_object(rows) for r in part]
    rows.sort(key=lambda r: r["position"])
    try:
        metrics = _metrics(rows, settings)
    except Exception as exc:
        raise RuntimeError(
            f"eval: computing the metrics of {len(rows)} scored problems failed "
            f"({type(exc).__name__}: {exc}); {_where_partial(partial_files)}"
        ) from exc
    return EvalResult(metrics=metrics, samples=rows, settings=settings,
                      seconds=time.perf_counter() - start, partial_files=partial_files)


def _evaluate_chunk(
    model: nn.Module,
    tokenizer: Any,
    dataset: Any,
    rewards: Any,
    settings: EvalSettings,
    chunk: list[int],
    *,
    num_real: int,
    extract: Any,
    partial: _PartialSamples,
    device: torch.device,
    logit_bias: torch.Tensor,
    allowed_tokens: torch.Tensor,
    stop_tokens: torch.Tensor,
    pad_id: int,
    cache_dtype: torch.dtype | None,
    tool_generator: Any = None,
) -> list[dict[str, Any]]:
    """Generate, score and record one micro-batch of problems.

    Args:
        chunk: dataset positions of the micro-batch; only the first ``num_real`` are this
            rank's problems, the rest repeat one to keep the ranks in lockstep.
        num_real: how many of ``chunk`` to keep.
        extract: the success reward's ``extract_answer`` (or None).
        partial: where each kept row is appended as soon as it is scored.
        (the other arguments as in :func:`evaluate`)

    Returns:
        The kept rows, in ``chunk`` order.
    """
    n = settings.num_samples
    items = [dataset[i] for i in chunk]
    batch = collate_prompts(items, pad_id=pad_id)
    tokens = batch["tokens"].to(device)
    generate = generate_trajectory if tool_generator is None else tool_generator.generate
    traj = generate(
        model, tokens, prompt_mask(tokens, batch["prompt_lengths"]), group_size=n,
        forward_batch_size=min(settings.forward_batch_size, len(chunk) * n),
        prompt_seeds=mix_seeds(settings.seed, batch["indices"]),
        max_generated_tokens=settings.max_generated_tokens,
        temperature=settings.temperature, top_k=settings.top_k, stop_tokens=stop_tokens,
        pad_id=pad_id, logit_bias=logit_bias,
        all_done=lambda done: D.all_ranks_true(done, device), cache_dtype=cache_dtype,
    )
    completions, scored = score_rollout(
        rewards, tokenizer, traj, batch, group_size=n, allowed_tokens=allowed_tokens,
        max_generated_tokens=settings.max_generated_tokens,
        with_tools=tool_generator is not None)
    transcripts = None
    if tool_generator is not None:
        from torchtune_grpo.rollout.multiturn import tool_segments

        tool_generator.pop_stats()  # the metrics are counted from the transcripts
        transcripts = tool_segments(tokenizer, traj, stop_tokens.tolist())
    rows: list[dict[str, Any]] = []
    for j, dataset_index in enumerate(chunk):
        if j >= num_real:
            break  # lockstep padding
        sl = slice(j * n, (j + 1) * n)
        texts = completions[sl]
        row = {
            "index": int(batch["indices"][j]),
            "position": dataset_index,
            "question": batch["questions"][j],
            "prompt": decode_prompt(tokenizer, items[j]["tokens"]),
            "gold": batch["answers"][j],
            "completions": texts,
            "extracted": [_answer_key(extract, t) for t in texts],
            "correct": [bool(x) for x in scored.success[sl].tolist()],
            "rewards": {k: v[sl].tolist() for k, v in scored.components.items()},
        }
        if transcripts is not None:
            row["transcripts"] = transcripts[sl]
        partial.append(row)
        rows.append(row)
    return rows


def _metrics(rows: list[dict[str, Any]], settings: EvalSettings) -> dict[str, float]:
    if not rows:
        return {}
    n = settings.num_samples
    metrics: dict[str, float] = {}
    for k in sorted(set(settings.k) | {1}):
        metrics[f"pass@{k}"] = sum(pass_at_k(n, sum(r["correct"]), k) for r in rows) / len(rows)
        if k == 1:  # 95% Wilson interval over problems (of per-problem pass rates when n > 1)
            low, high = wilson_interval(metrics["pass@1"] * len(rows), len(rows))
            metrics["pass@1/ci95_low"], metrics["pass@1/ci95_high"] = low, high
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
    if "transcripts" in rows[0]:  # a multi-turn evaluation: tool results per completion
        results = [s["text"] for r in rows for t in r["transcripts"] for s in t
                   if s["source"] == "tool"]
        metrics["tools/calls_per_completion"] = len(results) / (len(rows) * n)
        metrics["tools/errors"] = sum(_is_tool_error(t) for t in results) / (len(rows) * n)
    return metrics


def _is_tool_error(segment: str) -> bool:
    """Whether a tool segment's text (``<result>error: ...</result>``) reports an error."""
    from torchtune_grpo.rollout.tools import ERROR_PREFIX

    return ERROR_PREFIX in segment
