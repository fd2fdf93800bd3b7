"""Building the parts of :class:`~torchtune_grpo.training.recipe.GRPORecipe`: the output folder,
the engines, the policy and its reference, the optimizer, the settings of each part; and
:class:`LocalRollouts`, the recipe's rollout source when it samples its own rollouts.

Every builder takes what it reads and returns what it builds; the recipe holds the results.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.checkpoints.recipe_state import (
    CheckpointSettings,
    NoEntries,
    RecipeStateEntries,
    full_model_state,
)
from torchtune_grpo.checkpoints.resume_changes import (
    check_changes,
    config_changes,
    describe_changes,
    load_saved_config,
)
from torchtune_grpo.checkpoints.run_lock import FolderLock
from torchtune_grpo.checkpoints.saving import (
    check_finite,
    check_writable,
    claim_output_dir,
    load_recipe_state,
    resolve_resume,
    resume_hint,
)
from torchtune_grpo.checkpoints.step_folder import (
    check_model_folder,
    model_folder_files,
    write_missing_files,
)
from torchtune_grpo.config.schema import Key
from torchtune_grpo.config.validation import ConfigError, validate_config
from torchtune_grpo.errors import CheckpointError, UserError, one_line, report
from torchtune_grpo.evaluation.during_training import EvalSources
from torchtune_grpo.models.checkpointer import weight_files
from torchtune_grpo.policy.logprobs import auto_chunk_size
from torchtune_grpo.policy.model import DTYPES, build_model, has_adapters, meta_model
from torchtune_grpo.rollout.multiturn import ToolUseGenerator
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import Generator
from torchtune_grpo.training.update import PolicyUpdate, UpdateSettings

log = utils.get_logger("INFO")


def load_weights(checkpointer: Any) -> dict[str, torch.Tensor]:
    """The model weights a torchtune checkpointer loads (torchtune names).

    Raises:
        CheckpointError: the files do not load as the folder's ``config.json`` describes them
            (a weight of another shape than the converter expects, a corrupt file), naming the
            folder; a missing file stays a ``FileNotFoundError``.
    """
    try:
        return checkpointer.load_checkpoint()[training.MODEL_KEY]
    except (RuntimeError, ValueError, KeyError) as exc:
        folder = getattr(checkpointer, "_checkpoint_dir", "the checkpoint")
        raise CheckpointError(f"cannot load the weights in {folder} ({one_line(str(exc))}): "
                              "do its config.json and weight files belong together?") from exc


@dataclass
class Policy:
    """The models a run trains with.

    Args:
        model: the policy, trainable (FSDP2-sharded on several ranks).
        ref_model: the frozen reference (a KL term without LoRA), or None.
        checkpointer: the torchtune checkpointer the policy's weights came from (and the step
            folders are written with).
        activation_offloading: the context the update's forward passes run in.
    """

    model: nn.Module
    ref_model: nn.Module | None
    checkpointer: Any
    activation_offloading: contextlib.AbstractContextManager


def claim_output(cfg: DictConfig) -> tuple[FolderLock, dict[str, bytes]]:
    """Rank 0: check ``output_dir`` is writable, lock it for this run, and read the files
    written into every step folder (``config.json``, tokenizer, chat template...)."""
    check_writable(cfg.output_dir)
    lock = FolderLock(cfg.output_dir, "training").acquire()
    return lock, model_folder_files(cfg.checkpointer.get("checkpoint_dir") or "",
                                    tokenizer_cfg=cfg.tokenizer)


def build_engine(cfg: DictConfig) -> Generator:
    """The rollout engine: ``generator:`` instantiated, or the native engine (null)."""
    return config.instantiate(cfg.generator) if cfg.generator is not None else NativeGenerator()


def build_tool_generators(cfg: DictConfig, tokenizer: Any, engine: Generator
                          ) -> tuple[ToolUseGenerator, ToolUseGenerator]:
    """``(training, evaluation)`` multi-turn engines for ``tools:``: the training one samples
    each turn with ``engine``, the evaluation one with the native engine; tools run in
    between."""
    train = ToolUseGenerator(cfg.tools, tokenizer=tokenizer, inner=engine,
                             syntax=cfg.tool_syntax, max_tool_calls=int(cfg.max_tool_calls))
    evaluation = ToolUseGenerator(list(train.tools.values()), tokenizer=tokenizer,
                                  syntax=train.syntax, max_tool_calls=int(cfg.max_tool_calls))
    return train, evaluation


def model_shape(cfg: DictConfig) -> tuple[int | None, bool]:
    """``(max_seq_len, has LoRA adapters)`` of the configured model, built on the meta device;
    the base folder is checked to hold that model.

    Raises:
        ConfigError: the model builder rejects its arguments.
    """
    try:  # dims and adapters before any weight is loaded
        shape = meta_model(cfg.model)
    except (ValueError, TypeError, AssertionError) as e:  # the builder rejects its arguments
        raise ConfigError(f"config key 'model' ({cfg.model.get('_component_')}): "
                          f"{e}") from e
    check_model_folder(cfg, shape)  # the base folder is the model the config builds
    return getattr(shape, "max_seq_len", None), has_adapters(shape)


class PeerRankLost(UserError):
    """Another rank of the run died (killed, out of memory) while this one waited on it in a
    collective: reported in one line with the checkpoint to resume from."""


@contextlib.contextmanager
def failures_reported_first(output_dir: str) -> Iterator[None]:
    """Print a user error, or the death of a peer rank seen in a collective, as its one line
    *before* the recipe cleans up: torchrun stops the surviving workers soon after one fails,
    and a line left for the entry point would be lost with them.

    Raises:
        UserError: the error raised inside, already printed (:func:`~torchtune_grpo.errors.
            report`).
        PeerRankLost: for a collective's failure because another rank died; names the newest
            complete step folder of ``output_dir``.
    """
    try:
        yield
    except UserError as exc:
        report(exc)
        raise
    except RuntimeError as exc:
        if (why := D.peer_died(exc)) is None:
            raise
        lost = PeerRankLost(f"another rank of the run died ({why}); {resume_hint(output_dir)}")
        report(lost)
        raise lost from None


def resume_folder(cfg: DictConfig, model_files: dict[str, bytes], *, global_batch_size: int,
                  is_rank_zero: bool) -> tuple[Path | None, tuple[dict[str, Any], ...]]:
    """``(the step folder to resume from or None, the config changes against it)``; rank 0
    restores files a resumed folder lacks, and claims ``output_dir`` for a fresh run
    (``overwrite_output_dir``). The changes are :func:`resume_changes`'.

    Raises:
        CheckpointError: the config changes what the run means (:func:`resume_changes`).
    """
    resume_dir = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if resume_dir is not None and is_rank_zero:
        restored = write_missing_files(resume_dir, model_files)
        if restored:  # a folder written after a resume by an older version
            log.warning(f"{resume_dir} lacked {', '.join(restored)}; restored them from "
                        f"the base model folder {cfg.checkpointer.get('checkpoint_dir')}")
    if resume_dir is None and is_rank_zero:  # before any model is built
        deleted = claim_output_dir(cfg.output_dir, overwrite=cfg.overwrite_output_dir)
        if deleted:
            log.warning(f"overwrite_output_dir: deleted {len(deleted)} step folder(s) of "
                        f"an earlier run in {cfg.output_dir}")
    return resume_dir, resume_changes(cfg, resume_dir, global_batch_size=global_batch_size,
                                      is_rank_zero=is_rank_zero)


def build_policy(cfg: DictConfig, resume_dir: Path | None, *, is_lora: bool,
                 needs_reference: bool, device: torch.device, dtype: torch.dtype,
                 world_size: int, is_rank_zero: bool, dp_mesh: Any) -> Policy:
    """The policy (from the base model or the step folder to resume) and, for a KL term
    without LoRA, the frozen reference (always the base model)."""
    base_checkpointer = config.instantiate(cfg.checkpointer)
    adapter_state = None
    if resume_dir is None or is_lora:
        # a LoRA step folder holds merged weights: rebuild base + saved adapters instead
        checkpointer = base_checkpointer
        state_dict = base_state = load_weights(checkpointer)
        check_finite(state_dict, f"the weights in {cfg.checkpointer.get('checkpoint_dir')}",
                     action="load")
        if resume_dir is not None:
            adapter_state = load_recipe_state(resume_dir)["adapter"]
    else:
        checkpointer = config.instantiate(
            cfg.checkpointer, checkpoint_dir=str(resume_dir),
            checkpoint_files=weight_files(resume_dir),
        )
        state_dict = load_weights(checkpointer)
        check_finite(state_dict, f"the weights in {resume_dir}", action="load")
        base_state = load_weights(base_checkpointer) if needs_reference else None

    def build(state: dict[str, torch.Tensor], trainable: bool,
              adapters: dict[str, torch.Tensor] | None = None) -> nn.Module:
        return build_model(
            cfg.model, state, device=device, dtype=dtype, world_size=world_size,
            trainable=trainable, adapter_state_dict=adapters,
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
            reshard_after_forward=cfg.fsdp_reshard_after_forward, dp_mesh=dp_mesh,
            reduce_dtype=DTYPES[cfg.fsdp_reduce_dtype])

    model = build(state_dict, True, adapter_state)
    if cfg.compile:
        training.compile_model(model, verbose=is_rank_zero)
    offloading = training.get_act_offloading_ctx_manager(model, cfg.enable_activation_offloading)
    ref_model = build(base_state, False) if needs_reference and not is_lora else None
    return Policy(model, ref_model, checkpointer, offloading)


def build_optimizer(cfg: DictConfig, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """``(optimizer, lr_scheduler or None)`` over ``model``'s trainable parameters; the
    scheduler counts ``num_steps * ppo_epochs`` optimizer steps."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = config.instantiate(cfg.optimizer, trainable)
    lr_scheduler = None
    if cfg.lr_scheduler is not None:
        lr_scheduler = config.instantiate(
            cfg.lr_scheduler, optimizer=optimizer,
            num_training_steps=cfg.num_steps * cfg.ppo_epochs)
    return optimizer, lr_scheduler


def packed_forward(cfg: DictConfig) -> bool:
    """Whether the update runs on packed rows: ``packed_forward`` when set, else packed unless
    ``compile: true`` (``packed_forward: true`` with ``compile: true`` fails validation)."""
    return bool(cfg.packed_forward) if cfg.packed_forward is not None else not cfg.compile


def update_settings(cfg: DictConfig, *, seed: int, forward_batch_size: int,
                    vocab_size: int) -> UpdateSettings:
    """The :class:`~torchtune_grpo.training.update.PolicyUpdate` settings of ``cfg``
    (``vocab_size``: the logit bias's, for the automatic log-prob chunk)."""
    return UpdateSettings(
        ppo_epochs=int(cfg.ppo_epochs), forward_batch_size=forward_batch_size,
        group_size=int(cfg.group_size), seed=seed, temperature=cfg.temperature,
        packed=packed_forward(cfg), share_prompt_forward=bool(cfg.share_prompt_forward),
        clip_grad_norm=cfg.clip_grad_norm,
        skip_zero_advantage_sequences=bool(cfg.skip_zero_advantage_sequences),
        gather_weights=bool(cfg.rollout_gather_weights),
        chunk_size=int(cfg.logprob_chunk_size or auto_chunk_size(vocab_size)),
        keep_probs=int(cfg.logprob_keep_probs_mib) * 2**20 // 4)  # float32 elements


def checkpoint_settings(cfg: DictConfig, *, seed: int, global_batch_size: int,
                        config_changes: tuple[dict[str, Any], ...] = ()) -> CheckpointSettings:
    """The :class:`~torchtune_grpo.checkpoints.recipe_state.StepCheckpoints` settings of
    ``cfg`` (``config_changes``: what :func:`resume_changes` found)."""
    eval_data = cfg.eval_dataset
    return CheckpointSettings(
        output_dir=cfg.output_dir, seed=seed, global_batch_size=global_batch_size,
        keep_last_n=cfg.keep_last_n_checkpoints,
        save_adapter_weights_only=bool(cfg.save_adapter_weights_only), model_cfg=cfg.model,
        eval_dataset=("", "") if eval_data is None else (
            str(eval_data.get("_component_")), str(eval_data.get("split", ""))),
        config=OmegaConf.to_container(cfg, resolve=True), config_changes=config_changes)


def resume_changes(cfg: DictConfig, resume_dir: Path | None, *, global_batch_size: int,
                   is_rank_zero: bool) -> tuple[dict[str, Any], ...]:
    """Compare ``cfg`` with the config saved in ``resume_dir``, before any model is built.

    Rank 0 logs every changed key in one block. A change of what the run means (the data, the
    group, the model, the seed; :data:`~torchtune_grpo.checkpoints.resume_changes.FIXED`)
    raises unless ``resume_allow_changes``.

    Returns:
        The changes as records for the recipe state (empty for a fresh run).

    Raises:
        CheckpointError: a fixed key changed and ``resume_allow_changes`` is false.
    """
    if resume_dir is None:
        return ()
    saved, saved_batch, step = load_saved_config(resume_dir)
    changes = config_changes(saved, OmegaConf.to_container(cfg, resolve=True),
                             saved_global_batch=saved_batch, new_global_batch=global_batch_size)
    check_changes(changes, resume_dir, allow=bool(cfg.resume_allow_changes))
    if is_rank_zero:
        log.info(describe_changes(changes, resume_dir))
        if any(c.fixed for c in changes):
            log.warning("resume_allow_changes: continuing with "
                        f"{', '.join(c.key for c in changes if c.fixed)} changed; the change is "
                        "recorded in the recipe state of the steps saved from now on")
    return tuple(c.record(step) for c in changes)


def eval_sources(cfg: DictConfig) -> EvalSources:
    """What names ``cfg``'s start evaluation (:class:`EvalSources`)."""
    return EvalSources(
        output_dir=cfg.output_dir, base_model_dir=cfg.checkpointer.get("checkpoint_dir"),
        dataset=OmegaConf.to_container(cfg.eval_dataset, resolve=True),
        rewards=OmegaConf.to_container(cfg.rewards, resolve=True),
        tokenizer=OmegaConf.to_container(cfg.tokenizer, resolve=True),
        tools=OmegaConf.to_container(cfg, resolve=True).get("tools"))


# ---------------------------------------------------------------------------- rollout sources
class RolloutSource(Protocol):
    """Where a recipe's rollouts come from, and what follows from it: its process group, its
    generator, the recipe-state entries and metrics it adds. :class:`LocalRollouts` samples on
    the training ranks; the asynchronous trainer's source receives rollouts from rollout ranks
    (:mod:`torchtune_grpo.training.async_recipe`)."""

    #: config keys beyond :data:`~torchtune_grpo.config.schema.RECIPE_KEYS`
    extra_keys: dict[str, Key]

    def validate(self, cfg: DictConfig) -> None:
        """Check ``cfg`` before anything is built (raises ``ConfigError``)."""

    def process_group(self, device: torch.device, timeout_s: float) -> D.Ranks:
        """The ranks that train together."""

    def device_mesh(self, ranks: D.Ranks, device: torch.device) -> Any:
        """The mesh FSDP2 shards over (None: the whole world)."""

    def generator(self, engine: Generator, cfg: DictConfig) -> Generator:
        """The generator the recipe rolls out with, given the configured ``engine``."""

    def model_state(self, model: nn.Module, ranks: D.Ranks,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """The full model state dict on rank 0 (every rank calls it)."""

    def state_entries(self, model: nn.Module, ranks: D.Ranks) -> RecipeStateEntries:
        """The entries this source adds to ``recipe_state.pt``."""

    def behavior_is_current(self, step: int) -> bool:
        """Whether the rollout of ``step`` was sampled with the weights its update starts
        from."""

    def begin_step(self, step: int) -> None:
        """Called before the rollouts of ``step``."""

    def after_rollout(self, traj: Trajectory, step: int, update: PolicyUpdate) -> None:
        """Called with each rollout of ``step`` as it arrives."""

    def step_metrics(self, step: int, metrics: dict[str, float], ranks: D.Ranks,
                     device: torch.device) -> None:
        """Add this source's metrics of ``step`` to ``metrics`` (may be a collective)."""

    def finish(self) -> None:
        """Called once the training loop ends."""


class LocalRollouts:
    """The synchronous recipe's source: every training rank samples its own rollouts with the
    configured engine, under the default process group (this process alone without
    torchrun)."""

    extra_keys: dict[str, Key] = {}

    def validate(self, cfg: DictConfig) -> None:
        """:func:`~torchtune_grpo.config.validation.validate_config` with the world size
        torchrun set."""
        validate_config(cfg, world_size=world_size_from_env())

    def process_group(self, device: torch.device, timeout_s: float) -> D.Ranks:
        """The default process group under torchrun (this process alone without)."""
        D.init_distributed(device, timeout_s=timeout_s)
        return D.WORLD

    def device_mesh(self, ranks: D.Ranks, device: torch.device) -> Any:
        """None: FSDP2 shards over the whole world."""
        return None

    def generator(self, engine: Generator, cfg: DictConfig) -> Generator:
        """The configured engine itself."""
        return engine

    def model_state(self, model: nn.Module, ranks: D.Ranks,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """:func:`~torchtune_grpo.checkpoints.recipe_state.full_model_state`."""
        return full_model_state(model, ranks, device)

    def state_entries(self, model: nn.Module, ranks: D.Ranks) -> RecipeStateEntries:
        """None beyond the recipe's own."""
        return NoEntries()

    def behavior_is_current(self, step: int) -> bool:
        """Always: each step samples with the weights its update starts from."""
        return True

    def begin_step(self, step: int) -> None:
        """Nothing."""

    def after_rollout(self, traj: Trajectory, step: int, update: PolicyUpdate) -> None:
        """Nothing."""

    def step_metrics(self, step: int, metrics: dict[str, float], ranks: D.Ranks,
                     device: torch.device) -> None:
        """Nothing."""

    def finish(self) -> None:
        """Nothing."""


def world_size_from_env() -> int:
    """``WORLD_SIZE`` set by torchrun (1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """``RANK`` set by torchrun (0 without)."""
    return int(os.environ.get("RANK", "0"))
