"""Evaluations of a training run as one part, :class:`TrainingEvaluation`: every
``eval_every_n_steps`` and before the first step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchtune import utils

from torchtune_grpo import distributed as D
from torchtune_grpo.errors import Interrupted
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted, evaluate
from torchtune_grpo.evaluation.results import (
    START_EVAL_DIR,
    EvalResult,
    eval_fingerprint,
    stored_eval_metrics,
)
from torchtune_grpo.evaluation.settings import EvalSettings

log = utils.get_logger("INFO")


@dataclass(frozen=True)
class EvalSources:
    """What names an evaluation before the first step, in its fingerprint and its files.

    Args:
        output_dir: the run's output folder (the start evaluation goes to
            ``output_dir/eval_step_0``).
        base_model_dir: the base model's folder (``checkpointer.checkpoint_dir``).
        dataset: the resolved ``eval_dataset`` node.
        rewards: the resolved ``rewards`` node.
        tokenizer: the resolved ``tokenizer`` node.
        tools: the resolved ``tools`` node, or None.
    """

    output_dir: str
    base_model_dir: str | None
    dataset: dict[str, Any]
    rewards: Any
    tokenizer: dict[str, Any]
    tools: Any


class TrainingEvaluation:
    """The live policy evaluated on ``eval_dataset`` during training, stopped cleanly by Ctrl-C
    or SIGTERM.

    Args:
        model: the policy.
        tokenizer: its tokenizer.
        dataset: the evaluation problems.
        rewards: the run's reward set (its success component decides correctness).
        settings: the evaluation's sampling settings.
        rules: the token rules (``logit_bias``, ``allowed``, ``stop_tokens``, ``pad_id``).
        ranks: the ranks that evaluate together.
        device: where the model runs.
        cache_dtype: the KV cache's dtype.
        sources: what names the start evaluation.
        stop: the run's stop signals (``signalled``: a Ctrl-C or SIGTERM arrived;
            ``requested``: its name).
        metric_logger: rank 0: torchtune's metric logger, or None.
        gather_weights: under FSDP2, gather the weights once for the whole evaluation.
        tool_generator: the multi-turn engine evaluations run with, or None.
        progress: report progress on rank 0.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, dataset: Any, rewards: Any,
                 settings: EvalSettings, *, rules: Any, ranks: D.Ranks, device: torch.device,
                 cache_dtype: torch.dtype, sources: EvalSources, stop: Any,
                 metric_logger: Any, gather_weights: bool, tool_generator: Any,
                 progress: bool) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.rewards = rewards
        self.settings = settings
        self.rules = rules
        self.ranks = ranks
        self.device = device
        self.cache_dtype = cache_dtype
        self.sources = sources
        self.stop = stop
        self.metric_logger = metric_logger
        self.gather_weights = gather_weights
        self.tool_generator = tool_generator
        self.progress = progress
        self.is_rank_zero = ranks.rank() == 0

    def run(self, step: int, partial_dir: Path | None = None,
            fingerprint: str | None = None) -> EvalResult:
        """Evaluate the current policy after ``step`` steps; log ``eval/...`` metrics.

        Stops after the current batch of problems when a stop was requested (Ctrl-C, SIGTERM),
        raising :class:`~torchtune_grpo.evaluation.evaluate.EvaluationInterrupted`; with
        ``partial_dir`` and ``fingerprint`` the finished rows are kept there and resumed.
        """
        rules = self.rules
        result = evaluate(
            self.model, self.tokenizer, self.dataset, self.rewards, self.settings,
            device=self.device, logit_bias=rules.logit_bias, allowed_tokens=rules.allowed,
            stop_tokens=rules.stop_tokens, pad_id=rules.pad_id, cache_dtype=self.cache_dtype,
            gather_weights=self.gather_weights, tool_generator=self.tool_generator,
            ranks=self.ranks, progress=self.progress, partial_dir=partial_dir,
            fingerprint=fingerprint, should_stop=lambda: self.stop.signalled,
        )
        metrics = {f"eval/{k}": v for k, v in result.metrics.items()}
        metrics["eval/problems_per_second"] = len(result.samples) / max(result.seconds, 1e-9)
        self._log(step, metrics)
        return result

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=step)
        if self.is_rank_zero:
            log.info(f"step {step}: " + ", ".join(
                f"{k}={v:.4f}" for k, v in metrics.items()))

    def run_at_start(self) -> None:
        """The evaluation before the first step (``eval_at_start``), kept in
        ``output_dir/eval_step_0/`` (``eval_results.json``, ``eval_samples.jsonl``).

        The same run started again (same base weights, eval data, settings, rewards) reuses
        it; an interrupted one is resumed from the rows it finished.

        Raises:
            Interrupted: Ctrl-C or SIGTERM during it (one line, exit 130 or 143), keeping the
                finished rows.
        """
        src = self.sources
        folder = Path(src.output_dir) / START_EVAL_DIR
        fingerprint = eval_fingerprint(
            src.base_model_dir, dataset=src.dataset, settings=self.settings.__dict__,
            rewards=src.rewards, tokenizer=src.tokenizer, tools=src.tools)
        stored = stored_eval_metrics(folder, fingerprint) if self.is_rank_zero else None
        stored = self.ranks.all_gather_object(stored)[0]  # rank 0 read the files
        if stored is not None:
            if self.is_rank_zero:
                log.info(f"the start evaluation of this run is in {folder}: reusing it")
            self._log(0, {f"eval/{k}": v for k, v in stored.items()})
            return
        try:
            result = self.run(0, partial_dir=folder, fingerprint=fingerprint)
        except EvaluationInterrupted as exc:
            code = 143 if self.stop.requested == "SIGTERM" else 130
            raise Interrupted(f"{exc}; run the same command again to continue it "
                              "(nothing was trained yet)", code) from None
        if self.is_rank_zero:
            result.write(folder, dataset=str(src.dataset.get("_component_")),
                         split=str(src.dataset.get("split", "")),
                         model_path=str(src.base_model_dir), step=0,
                         fingerprint=fingerprint)
        self.ranks.barrier()
