"""Evaluation of a policy on a whole test split: pass@1, pass@k, maj@k, reward means.

Used by ``tune run grpo_eval`` and by training every ``eval_every_n_steps``; both write an
:class:`~torchtune_grpo.evaluation.results.EvalResult`. With tools the evaluation runs the
multi-turn rollout. Problems are split across ranks, each running the same number of
micro-batches (lockstep), and every rank gets all results.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchtune import utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.trajectory import prompt_mask
from torchtune_grpo.backends import backend_for
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.errors import Interrupted
from torchtune_grpo.evaluation.metrics import compute_metrics
from torchtune_grpo.evaluation.results import (
    EvalResult,
    PartialSamples,
    partial_samples_path,
    read_partial_rows,
    where_partial,
)
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.progress import Progress
from torchtune_grpo.rewards.scoring import score_rollout
from torchtune_grpo.rollout.native import generate_trajectory
from torchtune_grpo.rollout.protocol import GenerationRequest
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.token_rules import safe_decode

_log = utils.get_logger("INFO")

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
    """Text of a prompt, special tokens (chat headers, BOS) kept where the tokenizer's ``decode``
    takes ``skip_special_tokens``; never raises (falls back to
    :func:`~torchtune_grpo.token_rules.safe_decode`, which skips undecodable ids).

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


def _answer_key(extract, completion: str) -> Any:
    if extract is None:
        text = completion.strip()
        return text or None
    value = extract(completion)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class EvaluationInterrupted(Interrupted):
    """An evaluation stopped on request (Ctrl-C, SIGTERM) before its last problem.

    Attributes:
        finished: problems scored (over all ranks), kept in ``partial_files``.
        total: problems in the dataset.
        partial_files: where the finished rows are.
    """

    def __init__(self, finished: int, total: int, partial_files: Sequence[Path]) -> None:
        where = (f"kept in {Path(partial_files[0]).parent}" if partial_files
                 else "not kept (no partial_dir)")
        super().__init__(f"evaluation interrupted after {finished} of {total} problems; they "
                         f"are {where}")
        self.finished, self.total, self.partial_files = finished, total, list(partial_files)


class EvalProgress:
    """Progress of an evaluation on rank 0: a bar on a terminal, else a line every ``every_s``
    seconds with the problems done, the decode step of the batch in flight and the time left
    (a :class:`~torchtune_grpo.progress.Progress`, which the generation requests report to);
    silent when not shown.

    Args:
        total: problems in the dataset.
        done: problems already finished (resumed rows).
        world: ranks evaluating together (rank 0 sees its own share; the count is scaled).
        show: whether to report at all.
        every_s: seconds between lines when not on a terminal.
    """

    def __init__(self, total: int, done: int, world: int, *, show: bool,
                 every_s: float | None = None) -> None:
        import sys

        from tqdm import tqdm

        self.total, self.done, self.world, self.every_s = total, done, world, every_s
        self.show = show
        self._new = 0
        self._bar = (tqdm(total=total, initial=done, desc="eval", disable=not show)
                     if show and sys.stderr.isatty() else None)
        if show and self._bar is None:
            _log.info(f"eval: {total} problems")
        #: what the generation requests of this evaluation report to
        self.work = Progress(show=show, every_s=every_s, emit=_log.info)
        self.work.bar = self._bar
        self.work.begin("eval", total=total, unit="problems", already=done)
        self.work.__enter__()

    def update(self, problems: int) -> None:
        """Rank 0 finished ``problems`` more (its own share)."""
        step = min(problems * self.world, self.total - self.done - self._new)
        self._new += step
        self.work.advance(step)
        if self._bar is not None:
            self._bar.update(step)

    def close(self) -> None:
        """Stop reporting; close the bar (if any)."""
        self.work.__exit__()
        if self._bar is not None:
            self._bar.close()


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
    ranks: D.Ranks = D.WORLD,
    fingerprint: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> EvalResult:
    """Evaluate ``model`` on every problem of ``dataset``; call on every rank, each gets the full
    result.

    Args:
        model: the policy (plain or FSDP-sharded torchtune decoder).
        tokenizer: its tokenizer.
        dataset: the problems (a :class:`PromptDataset`).
        rewards: a :class:`~torchtune_grpo.rewards.reward_set.RewardSet`; its success component
            decides correctness (its ``extract_answer``, if any, the votes of maj@k).
        settings: sampling settings.
        device: where the model runs.
        logit_bias: ``[V]`` bias forbidding undefined ids.
        allowed_tokens: ``[V]`` bool, ids that may be decoded.
        stop_tokens: ``[s]`` stop ids.
        pad_id: padding id.
        cache_dtype: KV-cache dtype.
        progress: report progress on rank 0 (:class:`EvalProgress`).
        partial_dir: folder of the per-rank partial sample files (None: rows in memory only).
        gather_weights: hold an FSDP2 model's full weights for the whole evaluation.
        tool_generator: a :class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator` sampling
            with ``model`` (rows then hold ``transcripts``); None: single-turn.
        ranks: the ranks that evaluate together (each takes every ``size``-th problem).
        fingerprint: with ``partial_dir``, resume the rows an interrupted run with this
            :func:`~torchtune_grpo.evaluation.results.eval_fingerprint` left there.
        should_stop: asked before each batch on every rank; any True stops all.

    Raises:
        EvaluationInterrupted: ``should_stop`` said so.
        RuntimeError: computing the metrics failed; the message says where the partial
            samples are.
    """

    start = time.perf_counter()
    world, rank = ranks.size(), ranks.rank()
    total = len(dataset)
    done: dict[int, dict[str, Any]] = {}
    if partial_dir is not None and fingerprint is not None:
        done = read_partial_rows(partial_dir, fingerprint)
        ranks.barrier()  # every rank has read the old files before any is rewritten
        if rank == 0:  # files of ranks beyond this world: their rows are carried below
            for path in Path(partial_dir).glob("eval_samples.rank*.partial.jsonl"):
                if not any(path == partial_samples_path(partial_dir, r) for r in range(world)):
                    path.unlink(missing_ok=True)
    if done and rank == 0:
        _log.info(f"eval: {len(done)} of {total} problems kept from an interrupted run of the "
                  f"same evaluation in {partial_dir}; continuing")
    carried = [done[p] for p in range(rank, total, world) if p in done]
    mine = [p for p in range(rank, total, world) if p not in done]
    counts = ranks.all_reduce(torch.tensor([len(mine)], device=device), "max")
    per_rank = int(counts.item())
    padded = mine + [mine[-1] if mine else 0] * (per_rank - len(mine))
    success_fn = next(e.fn for e in rewards.entries if e.name == rewards.success_name)
    extract = getattr(success_fn, "extract_answer", None)
    n = settings.num_samples
    prompts_per_batch = max(1, settings.forward_batch_size // n)
    was_training = model.training
    model.eval()
    rows: list[dict[str, Any]] = list(carried)
    partial_files = (
        [partial_samples_path(partial_dir, r) for r in range(world)] if partial_dir else []
    )
    partial = PartialSamples(partial_files[rank] if partial_files else None,
                             fingerprint=fingerprint, carried=carried)
    report = EvalProgress(total, len(done), world, show=progress and rank == 0)
    try:
        with D.gathered_for_inference(model, enabled=gather_weights):
            for offset in range(0, per_rank, prompts_per_batch):
                if should_stop is not None and not ranks.all_ranks_true(not should_stop(),
                                                                        device):
                    finished = int(ranks.all_reduce(
                        torch.tensor([len(rows)], device=device), "sum").item())
                    raise EvaluationInterrupted(finished, total, partial_files)
                chunk = padded[offset : offset + prompts_per_batch]
                rows.extend(_evaluate_chunk(
                    model, tokenizer, dataset, rewards, settings, chunk,
                    num_real=max(0, min(len(chunk), len(mine) - offset)), extract=extract,
                    partial=partial, device=device, logit_bias=logit_bias,
                    allowed_tokens=allowed_tokens, stop_tokens=stop_tokens, pad_id=pad_id,
                    cache_dtype=cache_dtype, tool_generator=tool_generator, ranks=ranks,
                    progress=report.work,
                ))
                report.update(len(chunk))
    finally:
        partial.close()
        report.close()
        if was_training:
            model.train()

    if world > 1:
        rows = [r for part in ranks.all_gather_object(rows) for r in part]
    rows.sort(key=lambda r: r["position"])
    try:
        metrics = compute_metrics(rows, settings)
    except Exception as exc:
        raise RuntimeError(
            f"eval: computing the metrics of {len(rows)} scored problems failed "
            f"({type(exc).__name__}: {exc}); {where_partial(partial_files)}"
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
    partial: PartialSamples,
    device: torch.device,
    logit_bias: torch.Tensor,
    allowed_tokens: torch.Tensor,
    stop_tokens: torch.Tensor,
    pad_id: int,
    cache_dtype: torch.dtype | None,
    tool_generator: Any = None,
    ranks: D.Ranks = D.WORLD,
    progress: Progress | None = None,
) -> list[dict[str, Any]]:
    """Generate, score and record one micro-batch of problems.

    Args:
        chunk: dataset positions; only the first ``num_real`` are this rank's problems, the rest
            lockstep padding.
        num_real: how many of ``chunk`` to keep.
        extract: the success reward's ``extract_answer`` (or None).
        partial: where each kept row is appended as soon as it is scored.
        progress: where the generation reports its decode steps.
        (the other arguments as in :func:`evaluate`)

    Returns:
        The kept rows, in ``chunk`` order.
    """
    n = settings.num_samples
    items = [dataset[i] for i in chunk]
    batch = collate_prompts(items, pad_id=pad_id)
    tokens = batch["tokens"].to(device)
    request = GenerationRequest(
        tokens, prompt_mask(tokens, batch["prompt_lengths"]), group_size=n,
        forward_batch_size=min(settings.forward_batch_size, len(chunk) * n),
        stop_check_interval=backend_for(device).stop_check_interval,
        prompt_seeds=mix_seeds(settings.seed, batch["indices"]),
        max_generated_tokens=settings.max_generated_tokens,
        temperature=settings.temperature, top_k=settings.top_k, stop_tokens=stop_tokens,
        pad_id=pad_id, logit_bias=logit_bias,
        all_done=lambda done: ranks.all_ranks_true(done, device), cache_dtype=cache_dtype,
        progress=progress,
    )
    traj = (generate_trajectory(model, request) if tool_generator is None
            else tool_generator.generate(model, request))
    completions, scored = score_rollout(
        rewards, tokenizer, traj, batch, group_size=n, allowed_tokens=allowed_tokens,
        max_generated_tokens=settings.max_generated_tokens,
        with_tools=tool_generator is not None)
    transcripts = None
    if tool_generator is not None:
        from torchtune_grpo.rollout.tool_trajectory import tool_segments

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
