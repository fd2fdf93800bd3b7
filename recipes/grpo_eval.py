"""Evaluate a checkpoint on a whole test split: greedy pass@1, pass@k, maj@k, reward means.

Usage::

    tune run grpo_eval --config grpo/eval_gsm8k checkpoint_dir=/tmp/grpo/qwen2_5_3B/step_200
    tune run --nproc_per_node 8 grpo_eval --config grpo/eval_gsm8k checkpoint_dir=...

Writes ``eval_results.json`` and ``eval_samples.jsonl`` into the output folder (see
:mod:`torchtune_grpo.evaluation.results`): ``eval_output_dir`` when set, else ``checkpoint_dir``;
an earlier evaluation's files there are replaced, and the log says so at start. With several
processes the problems are split across ranks and gathered; rank 0 writes the files.

While it runs, each rank appends every scored problem to
``<output folder>/eval_samples.rank{r}.partial.jsonl``; if anything fails after generation
(a metric, serialising or writing the results) those files keep the finished samples and the
error says where they are. Ctrl-C or SIGTERM stops after the current batch of problems, in one
line, keeping them; the same command then continues from them (same weights, data, sampling and
rewards). They are removed once the final files are in place. One evaluation at a time writes
into a folder: rank 0 holds ``<output folder>/.tune_grpo.lock`` while it runs, and a training
run's ``keep_last_n_checkpoints`` leaves a folder being evaluated in place (with
``eval_output_dir``, through a shared lock on ``checkpoint_dir`` where it is writable).

Tools: a checkpoint trained with ``tools:`` is evaluated with the same multi-turn rollout
(:class:`~torchtune_grpo.rollout.multiturn.ToolUseGenerator`): when the eval config has no
``tools`` key, ``tools``, ``max_tool_calls`` and ``tool_syntax`` are read from the
checkpoint's ``recipe_state.pt`` (the training config it holds); ``tools: null`` evaluates
single-turn. ``eval_samples.jsonl`` then stores each completion's ``transcripts`` with the
tool results marked.
"""

import os
from pathlib import Path
from typing import IO

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.checkpoints.run_lock import LOCK_FILE, FolderLock
from torchtune_grpo.checkpoints.step_folder import check_model_folder, tool_settings_from_checkpoint
from torchtune_grpo.config.loading import parse
from torchtune_grpo.config.schema import EVAL_KEYS, with_defaults
from torchtune_grpo.config.validation import (
    check_device,
    check_input_files,
    validate_config,
)
from torchtune_grpo.errors import Interrupted, UserError
from torchtune_grpo.evaluation.evaluate import EvaluationInterrupted, evaluate
from torchtune_grpo.evaluation.results import (
    RESULTS_FILE,
    SAMPLES_FILE,
    EvalResult,
    eval_fingerprint,
    partial_samples_path,
)
from torchtune_grpo.evaluation.settings import EvalSettings
from torchtune_grpo.policy.model import DTYPES, build_model, meta_model, token_rules
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.training.interrupts import StopSignals
from torchtune_grpo.training.parts import load_weights

log = utils.get_logger("INFO")


def output_dir(cfg: DictConfig) -> Path:
    """The folder the results go into: ``eval_output_dir``, else ``checkpoint_dir``."""
    folder = cfg.get("eval_output_dir")
    return Path(str(cfg.checkpoint_dir if folder is None else folder)).expanduser()


def write_results(result: EvalResult, cfg: DictConfig) -> list[Path]:
    """Write ``eval_results.json`` and ``eval_samples.jsonl`` into :func:`output_dir`.

    Atomic per file; the partial sample files are removed only after both are in place.

    Args:
        result: what :func:`~torchtune_grpo.evaluation.evaluate.evaluate` returned.
        cfg: the eval config (``checkpoint_dir``, ``eval_output_dir``, ``dataset``).

    Returns:
        ``[eval_results.json, eval_samples.jsonl]`` paths.
    """
    return result.write(
        output_dir(cfg),
        dataset=str(cfg.dataset.get("_component_")),
        split=str(cfg.dataset.get("split", "")),
        model_path=str(cfg.checkpoint_dir),
    )


def earlier_results_note(folder: Path) -> str | None:
    """The warning that ``folder`` holds an earlier evaluation's results, which this one will
    replace (naming the model they were for); None when it holds none."""
    results = folder / RESULTS_FILE
    if not results.is_file():
        return None
    import json

    try:
        of = f" (of {json.loads(results.read_text())['model_path']})"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        of = ""
    return (f"{results}{of} holds an earlier evaluation: this one replaces it and "
            f"{SAMPLES_FILE} when it ends (another eval_output_dir keeps both)")


def lock_output_dir(cfg: DictConfig) -> FolderLock:
    """Rank 0's lock on :func:`output_dir` (created if absent): one evaluation writes there at a
    time.

    Raises:
        UserError: the folder cannot be created or written, naming the key to change.
        FolderInUseError: another run holds it.
    """
    folder = output_dir(cfg)
    try:
        return FolderLock(folder, "grpo_eval").acquire()
    except OSError as exc:
        if cfg.get("eval_output_dir") is None:
            raise UserError(f"checkpoint_dir {folder} is not writable ({exc.strerror or exc}), "
                            "and the results are written into it: set eval_output_dir=DIR to "
                            "write them elsewhere") from None
        raise UserError(f"eval_output_dir {folder} is not writable ({exc.strerror or exc}); "
                        "choose another folder or fix its permissions") from None


def hold_for_reading(folder: Path) -> IO[str] | None:
    """A shared lock on ``folder``'s lock file while the checkpoint is read from elsewhere, so a
    training run's ``keep_last_n_checkpoints`` (which skips a locked folder) leaves it in place;
    None where the folder is read-only or an evaluation writing into it holds it already."""
    import fcntl

    try:
        handle = open(folder / LOCK_FILE, "a", encoding="utf-8")  # noqa: SIM115 (held)
    except OSError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


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
    lock = reading = None
    try:
        if rank == 0:  # one evaluation writing into a folder at a time
            lock = lock_output_dir(cfg)
            checkpoint = Path(str(cfg.checkpoint_dir)).expanduser()
            if output_dir(cfg).resolve() != checkpoint.resolve():
                reading = hold_for_reading(checkpoint)
            note = earlier_results_note(output_dir(cfg))
            if note is not None:
                log.warning(note)
        _evaluate_checkpoint(cfg, settings, device, world_size, rank, stop)
    finally:
        if reading is not None:
            reading.close()
        if lock is not None:
            lock.release()
        stop.restore()
        D.destroy()


def _evaluate_checkpoint(cfg: DictConfig, settings: EvalSettings, device: torch.device,
                         world_size: int, rank: int, stop: StopSignals) -> None:
    """Load ``cfg.checkpoint_dir``, evaluate it and write the results into :func:`output_dir`."""
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
                progress=cfg.progress_bar, partial_dir=output_dir(cfg),
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
    partial_samples_path(output_dir(cfg), rank).unlink(missing_ok=True)


if __name__ == "__main__":
    recipe_main()
