"""Evaluate a checkpoint on a whole test split: greedy pass@1, pass@k, maj@k, reward means.

Usage::

    tune run grpo_eval --config grpo/eval_gsm8k checkpoint_dir=/tmp/grpo/qwen2_5_3B/step_200
    tune run --nproc_per_node 8 grpo_eval --config grpo/eval_gsm8k checkpoint_dir=...

Writes ``eval_results.json`` and ``eval_samples.jsonl`` into ``checkpoint_dir`` (see
:mod:`torchtune_grpo.evaluation.results`). With several processes the problems are split across
ranks and gathered; rank 0 writes the files.

While it runs, each rank appends every scored problem to
``checkpoint_dir/eval_samples.rank{r}.partial.jsonl``; if anything fails after generation
(a metric, serialising or writing the results) those files keep the finished samples and the
error says where they are. Ctrl-C or SIGTERM stops after the current batch of problems, in one
line, keeping them; the same command then continues from them (same weights, data, sampling and
rewards). They are removed once the final files are in place. One evaluation at a time writes
into a folder: rank 0 holds ``checkpoint_dir/.tune_grpo.lock`` while it runs, and a training
run's ``keep_last_n_checkpoints`` leaves a folder being evaluated in place.

Tools: a checkpoint trained with ``tools:`` is evaluated with the same multi-turn rollout
(:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`): when the eval config has no
``tools`` key, ``tools``, ``max_tool_calls`` and ``tool_syntax`` are read from the
checkpoint's ``recipe_state.pt`` (the training config it holds); ``tools: null`` evaluates
single-turn. ``eval_samples.jsonl`` then stores each completion's ``transcripts`` with the
tool results marked.
"""

import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.checkpoints.run_lock import FolderLock
from torchtune_grpo.checkpoints.step_folder import check_model_folder, tool_settings_from_checkpoint
from torchtune_grpo.config.loading import parse
from torchtune_grpo.config.schema import EVAL_KEYS, with_defaults
from torchtune_grpo.config.validation import (
    check_device,
    check_input_files,
    validate_config,
)
from torchtune_grpo.errors import Interrupted
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted, evaluate
from torchtune_grpo.evaluation.results import EvalResult, eval_fingerprint, partial_samples_path
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.policy.model import DTYPES, build_model, meta_model, token_rules
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.training.interrupts import StopSignals
from torchtune_grpo.training.parts import load_weights

log = utils.get_logger("INFO")


def write_results(result: EvalResult, cfg: DictConfig) -> list[Path]:
    """Write ``eval_results.json`` and ``eval_samples.jsonl`` into ``cfg.checkpoint_dir``.

    Atomic per file; the partial sample files are removed only after both are in place.

    Args:
        result: what :func:`~torchtune_grpo.evaluation.evaluate.evaluate` returned.
        cfg: the eval config (``checkpoint_dir``, ``dataset``).

    Returns:
        ``[eval_results.json, eval_samples.jsonl]`` paths.
    """
    return result.write(
        cfg.checkpoint_dir,
        dataset=str(cfg.dataset.get("_component_")),
        split=str(cfg.dataset.get("split", "")),
        model_path=str(cfg.checkpoint_dir),
    )


@parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``--config NAME checkpoint_dir=DIR [key=value ...]``."""
    if ("tools" not in cfg and "checkpoint_dir" in cfg
            and not OmegaConf.is_missing(cfg, "checkpoint_dir")):
        # the tools the checkpoint was trained with
        for key, value in tool_settings_from_checkpoint(cfg.checkpoint_dir).items():
            if key == "tools" or key not in cfg:
                cfg[key] = value
    validate_config(cfg, schema=EVAL_KEYS)
    if not Path(str(cfg.checkpoint_dir)).expanduser().is_dir():
        raise FileNotFoundError(f"checkpoint_dir {cfg.checkpoint_dir} does not exist (a step_N "
                                "folder of a run, or a model folder)")
    cfg = with_defaults(cfg, EVAL_KEYS)
    stop = StopSignals("the evaluation", quiet=int(os.environ.get("RANK", "0")) != 0).install()
    settings = EvalSettings(
        num_samples=cfg.num_samples, temperature=float(cfg.temperature), top_k=cfg.top_k,
        k=list(cfg.k), max_generated_tokens=cfg.max_generated_tokens,
        forward_batch_size=cfg.forward_batch_size, seed=cfg.seed,
    )
    check_device(cfg.device)
    device = utils.get_device(cfg.device)
    world_size, rank = D.init_distributed(device)
    lock = None
    try:
        if rank == 0:  # one evaluation writing into a folder at a time
            lock = FolderLock(Path(str(cfg.checkpoint_dir)).expanduser(), "grpo_eval").acquire()
        _evaluate_checkpoint(cfg, settings, device, world_size, rank, stop)
    finally:
        if lock is not None:
            lock.release()
        stop.restore()
        D.destroy()


def _evaluate_checkpoint(cfg: DictConfig, settings: EvalSettings, device: torch.device,
                         world_size: int, rank: int, stop: StopSignals) -> None:
    """Load ``cfg.checkpoint_dir``, evaluate it and write the results into it."""
    dtype = DTYPES[cfg.dtype]
    check_input_files(cfg)  # truncated weights named before anything loads
    check_model_folder(cfg, meta_model(cfg.model), cfg.checkpointer.get("checkpoint_dir"))
    tokenizer = config.instantiate(cfg.tokenizer)
    tool_generator = None
    if cfg.tools:  # before the dataset: the chat-template tool format renders prompts with tools
        from torchtune_grpo.rollout.multiturn import ToolUseGenerator

        tool_generator = ToolUseGenerator(cfg.tools, tokenizer=tokenizer,
                                          syntax=cfg.tool_syntax,
                                          max_tool_calls=int(cfg.max_tool_calls))
    dataset = config.instantiate(cfg.dataset, tokenizer=tokenizer)
    rewards = build_reward_set(cfg.rewards)
    checkpointer = config.instantiate(cfg.checkpointer)
    state_dict = load_weights(checkpointer)
    model = build_model(cfg.model, state_dict, device=device, dtype=dtype,
                        world_size=world_size, trainable=False)
    del state_dict
    rules = token_rules(tokenizer, model, device)
    fingerprint = eval_fingerprint(
        cfg.checkpoint_dir, **{key: OmegaConf.to_container(cfg[key], resolve=True)
                               for key in ("dataset", "rewards", "tokenizer", "tools")
                               if key in cfg and cfg[key] is not None},
        settings=settings.__dict__)
    with stop.deferred():  # Ctrl-C: stop after the current batch, keep the finished rows
        try:
            result = evaluate(
                model, tokenizer, dataset, rewards, settings, device=device,
                logit_bias=rules.logit_bias, allowed_tokens=rules.allowed,
                stop_tokens=rules.stop_tokens, pad_id=rules.pad_id, cache_dtype=dtype,
                progress=cfg.progress_bar, partial_dir=cfg.checkpoint_dir,
                tool_generator=tool_generator, fingerprint=fingerprint,
                should_stop=lambda: stop.requested is not None,
            )
        except EvaluationInterrupted as exc:
            raise Interrupted(f"{exc}; run the same command again to continue it",
                              143 if stop.requested == "SIGTERM" else 130) from None
    if rank == 0:
        paths = write_results(result, cfg)  # on failure the partial files stay
        summary = ", ".join(f"{k}={v:.4f}" for k, v in result.metrics.items())
        log.info(f"{len(result.samples)} problems in {result.seconds:.1f}s: {summary}")
        log.info(f"wrote {paths[0]} and {paths[1]}")
    D.WORLD.barrier()  # the final files exist: every rank drops its own partial file
    partial_samples_path(cfg.checkpoint_dir, rank).unlink(missing_ok=True)


if __name__ == "__main__":
    recipe_main()
