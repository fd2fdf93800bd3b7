"""Evaluations of a training run: every ``eval_every_n_steps`` and before the first step
(part of :class:`~torchtune_grpo.training.recipe.GRPORecipe`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from torchtune import utils

from torchtune_grpo.errors import Interrupted
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted, evaluate
from torchtune_grpo.evaluation.results import (
    START_EVAL_DIR,
    EvalResult,
    eval_fingerprint,
    stored_eval_metrics,
)

log = utils.get_logger("INFO")


class RecipeEvaluation:
    """The evaluations of :class:`~torchtune_grpo.training.recipe.GRPORecipe`: the live policy
    on ``eval_dataset``, stopped cleanly by Ctrl-C or SIGTERM (``self.stop``)."""

    def run_eval(self, partial_dir: Path | None = None,
                 fingerprint: str | None = None) -> EvalResult:
        """Evaluate the current policy on ``eval_dataset``; log ``eval/...`` metrics.

        Stops after the current batch of problems when a stop was requested (Ctrl-C, SIGTERM),
        raising :class:`~torchtune_grpo.evaluation.evaluate.EvaluationInterrupted`; with
        ``partial_dir`` and ``fingerprint`` the finished rows are kept there and resumed.
        """
        result = evaluate(
            self.model, self.tokenizer, self.eval_dataset, self.rewards, self.eval_settings,
            device=self.device, logit_bias=self.logit_bias, allowed_tokens=self.allowed_tokens,
            stop_tokens=self.stop_tokens, pad_id=self.pad_id, cache_dtype=self.dtype,
            gather_weights=self.cfg.rollout_gather_weights,
            tool_generator=self.eval_tool_generator, ranks=self.ranks,
            progress=self.cfg.progress_bar, partial_dir=partial_dir, fingerprint=fingerprint,
            should_stop=lambda: self.stop.signalled,
        )
        metrics = {f"eval/{k}": v for k, v in result.metrics.items()}
        metrics["eval/problems_per_second"] = len(result.samples) / max(result.seconds, 1e-9)
        self._log_eval(metrics)
        return result

    def _log_eval(self, metrics: dict[str, float]) -> None:
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)
        if self.is_rank_zero:
            log.info(f"step {self.step}: " + ", ".join(
                f"{k}={v:.4f}" for k, v in metrics.items()))

    def run_start_eval(self) -> None:
        """The evaluation before the first step (``eval_at_start``), kept in
        ``output_dir/eval_step_0/`` (``eval_results.json``, ``eval_samples.jsonl``).

        The same run started again (same base weights, eval data, settings, rewards) reuses
        it; an interrupted one is resumed from the rows it finished. Ctrl-C or SIGTERM during
        it stops the run in one line, keeping those rows.
        """
        cfg = self.cfg
        folder = Path(cfg.output_dir) / START_EVAL_DIR
        fingerprint = eval_fingerprint(
            cfg.checkpointer.get("checkpoint_dir"),
            dataset=OmegaConf.to_container(cfg.eval_dataset, resolve=True),
            settings=self.eval_settings.__dict__,
            rewards=OmegaConf.to_container(cfg.rewards, resolve=True),
            tokenizer=OmegaConf.to_container(cfg.tokenizer, resolve=True),
            tools=OmegaConf.to_container(cfg, resolve=True).get("tools"))
        stored = stored_eval_metrics(folder, fingerprint) if self.is_rank_zero else None
        stored = self.ranks.all_gather_object(stored)[0]  # rank 0 read the files
        if stored is not None:
            if self.is_rank_zero:
                log.info(f"the start evaluation of this run is in {folder}: reusing it")
            self._log_eval({f"eval/{k}": v for k, v in stored.items()})
            return
        try:
            result = self.run_eval(partial_dir=folder, fingerprint=fingerprint)
        except EvaluationInterrupted as exc:
            code = 143 if self.stop.requested == "SIGTERM" else 130
            raise Interrupted(f"{exc}; run the same command again to continue it "
                              "(nothing was trained yet)", code) from None
        if self.is_rank_zero:
            result.write(folder, dataset=str(cfg.eval_dataset.get("_component_")),
                         split=str(cfg.eval_dataset.get("split", "")),
                         model_path=str(cfg.checkpointer.get("checkpoint_dir")), step=0,
                         fingerprint=fingerprint)
        self.ranks.barrier()
