"""Building a recipe's parts: data, rewards, loss, engine, models, optimizer (the setup of
:class:`~torchtune_grpo.training.recipe.GRPORecipe`)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torchtune import config, training, utils

from torchtune_grpo.checkpoints.run_lock import FolderLock
from torchtune_grpo.checkpoints.saving import (
    check_finite,
    check_writable,
    claim_output_dir,
    load_recipe_state,
    resolve_resume,
)
from torchtune_grpo.checkpoints.step_folder import (
    check_model_folder,
    model_folder_files,
    write_missing_files,
)
from torchtune_grpo.config.settings import HealthSettings, settings_from_config
from torchtune_grpo.config.validation import (
    ConfigError,
    check_input_files,
)
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.errors import CheckpointError, one_line
from torchtune_grpo.models.checkpointer import weight_files
from torchtune_grpo.policy.logprobs import auto_chunk_size
from torchtune_grpo.policy.model import build_model, has_adapters, meta_model, token_rules
from torchtune_grpo.rewards.build import build_reward_set
from torchtune_grpo.rollout.multiturn import ToolUseGenerator
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import GenerationContext, Generator
from torchtune_grpo.rollout.runtime import (
    RolloutRuntime,
    check_context_length,
    generation_context,
)
from torchtune_grpo.rollout.tool_trajectory import ToolStats
from torchtune_grpo.training.batching import (
    StepBatches,
)
from torchtune_grpo.training.health import RunHealth

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


class RecipeSetup:
    """The setup of :class:`~torchtune_grpo.training.recipe.GRPORecipe`: cheap, validating parts
    first (tokenizer, rewards, loss, engine, data), then the models and the optimizer."""

    def setup(self) -> None:
        """Build data, rewards and loss first (cheap, validating), then the models."""
        cfg = self.cfg
        check_input_files(cfg)  # the base model is read even when resuming
        if self.is_rank_zero:
            check_writable(cfg.output_dir)
            # one run per output_dir, held until the process ends (rank 0 holds it)
            self.output_lock = FolderLock(cfg.output_dir, "training").acquire()
            # config.json, tokenizer, chat template...: written into every step folder
            self.model_files = model_folder_files(cfg.checkpointer.get("checkpoint_dir") or "",
                                                  tokenizer_cfg=cfg.tokenizer)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.rewards = build_reward_set(cfg.rewards)
        self.health = None if cfg.run_health is None else RunHealth(
            settings_from_config(HealthSettings, cfg.run_health, "run_health"),
            success_component=self.rewards.success_name,
            gated_components=[e.name for e in self.rewards.entries if e.requires_success])
        self.loss_fn = config.instantiate(cfg.loss)
        self.generator: Generator = self.build_generator()
        self.tools_on = bool(cfg.tools)
        # multi-turn: the engine samples each turn, tools run in between; the recipe reads the
        # tool counts from it (pop_stats, part of the Generator protocol)
        self.tool_generator: ToolUseGenerator | None = None
        if self.tools_on:
            self.tool_generator = self.generator = ToolUseGenerator(
                cfg.tools, tokenizer=self.tokenizer, inner=self.generator,
                syntax=cfg.tool_syntax, max_tool_calls=int(cfg.max_tool_calls))
        # evaluation runs the same tools on the native engine (its own counts)
        self.eval_tool_generator = None if not self.tools_on else ToolUseGenerator(
            list(self.tool_generator.tools.values()), tokenizer=self.tokenizer,
            syntax=self.tool_generator.syntax, max_tool_calls=int(cfg.max_tool_calls))
        self._tool_stats = ToolStats()
        # after the tool engine: the chat-template tool format gives the tokenizer the tools'
        # schemas, which the prompts are rendered with
        self.dataset = config.instantiate(cfg.dataset, tokenizer=self.tokenizer)
        try:  # dims and adapters before any weight is loaded
            shape = meta_model(cfg.model)
        except (ValueError, TypeError, AssertionError) as e:  # the builder rejects its arguments
            raise ConfigError(f"config key 'model' ({cfg.model.get('_component_')}): "
                              f"{e}") from e
        check_model_folder(cfg, shape)  # the base folder is the model the config builds
        self.max_seq_len = getattr(shape, "max_seq_len", None)
        self.is_lora = has_adapters(shape)
        del shape
        check_context_length(self.dataset, self.cfg.max_generated_tokens, self.max_seq_len)
        self.batches = StepBatches(
            self.dataset, batch_size=self.batch_size, world_size=self.world_size,
            rank=self.rank, seed=self.seed, shuffle=cfg.shuffle,
            collate=partial(collate_prompts, pad_id=int(getattr(self.tokenizer, "pad_id", 0))),
        )
        # built only when an evaluation is scheduled (eval_dataset=null: none at all)
        self.eval_dataset = (config.instantiate(cfg.eval_dataset, tokenizer=self.tokenizer)
                             if cfg.eval_dataset is not None and self.evaluates() else None)
        self.resume_dir = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
        if self.resume_dir is not None and self.is_rank_zero:
            restored = write_missing_files(self.resume_dir, self.model_files)
            if restored:  # a folder written after a resume by an older version
                log.warning(f"{self.resume_dir} lacked {', '.join(restored)}; restored them from "
                            f"the base model folder {cfg.checkpointer.get('checkpoint_dir')}")
        if self.resume_dir is None and self.is_rank_zero:  # before any model is built
            deleted = claim_output_dir(cfg.output_dir, overwrite=cfg.overwrite_output_dir)
            if deleted:
                log.warning(f"overwrite_output_dir: deleted {len(deleted)} step folder(s) of "
                            f"an earlier run in {cfg.output_dir}")
        self.ranks.barrier()
        self._build_models()
        self._build_optimizer()
        if self.resume_dir is not None:
            self._load_recipe_state(load_recipe_state(self.resume_dir))
        if self.is_rank_zero and cfg.metric_logger is not None:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)

        self.rules = token_rules(self.tokenizer, self.model, self.device)
        self.allowed_tokens, self.logit_bias = self.rules.allowed, self.rules.logit_bias
        self.stop_tokens, self.pad_id = self.rules.stop_tokens, self.rules.pad_id
        self.chunk_size = int(cfg.logprob_chunk_size or auto_chunk_size(self.logit_bias.numel()))
        self.keep_probs = int(cfg.logprob_keep_probs_mib) * 2**20 // 4  # float32 elements
        self.rollouts = RolloutRuntime(
            self.generator, cfg, rules=self.rules, ranks=self.ranks, seed=self.seed,
            group_size=self.group_size, forward_batch_size=self.forward_batch_size,
            device=self.device, cache_dtype=self.dtype)
        self.generator.setup(self._generation_context())
        self.generator.sync_weights(self.model)  # a resumed or LoRA policy is not the base

    def evaluates(self) -> bool:
        """Whether this run evaluates at all (``eval_every_n_steps`` or ``eval_at_start``);
        the eval dataset is built only then. A subclass that evaluates on its own schedule
        returns True."""
        return bool(self.cfg.eval_every_n_steps) or bool(self.cfg.eval_at_start)

    def build_generator(self) -> Generator:
        """The rollout engine: ``generator:`` instantiated, or the native engine (null)."""
        cfg = self.cfg
        return config.instantiate(cfg.generator) if cfg.generator is not None else NativeGenerator()

    def _build_models(self) -> None:
        """The policy (from the base model or the step folder to resume) and, for a KL term
        without LoRA, the frozen reference (always the base model)."""
        cfg = self.cfg
        base_checkpointer = config.instantiate(cfg.checkpointer)
        needs_reference = self.loss_fn.needs_reference
        adapter_state = None
        if self.resume_dir is None or self.is_lora:
            # a LoRA step folder holds merged weights: rebuild base + saved adapters instead
            self.checkpointer = base_checkpointer
            state_dict = base_state = load_weights(self.checkpointer)
            check_finite(state_dict, f"the weights in {cfg.checkpointer.get('checkpoint_dir')}",
                         action="load")
            if self.resume_dir is not None:
                adapter_state = load_recipe_state(self.resume_dir)["adapter"]
        else:
            self.checkpointer = config.instantiate(
                cfg.checkpointer, checkpoint_dir=str(self.resume_dir),
                checkpoint_files=weight_files(self.resume_dir),
            )
            state_dict = load_weights(self.checkpointer)
            check_finite(state_dict, f"the weights in {self.resume_dir}", action="load")
            base_state = (load_weights(base_checkpointer)
                          if needs_reference else None)
        self.model = self._build_model(state_dict, trainable=True, adapter_state=adapter_state)
        if cfg.compile:
            training.compile_model(self.model, verbose=self.is_rank_zero)
        self.activation_offloading = training.get_act_offloading_ctx_manager(
            self.model, cfg.enable_activation_offloading)
        self.ref_model = (self._build_model(base_state, trainable=False)
                          if needs_reference and not self.is_lora else None)

    def _build_model(self, state_dict: dict[str, torch.Tensor], *, trainable: bool,
                     adapter_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        cfg = self.cfg
        return build_model(
            cfg.model, state_dict, device=self.device, dtype=self.dtype,
            world_size=self.world_size, trainable=trainable, adapter_state_dict=adapter_state,
            activation_checkpointing=cfg.enable_activation_checkpointing,
            fsdp_cpu_offload=cfg.fsdp_cpu_offload,
            reshard_after_forward=cfg.fsdp_reshard_after_forward, dp_mesh=self.dp_mesh,
        )

    def _build_optimizer(self) -> None:
        cfg = self.cfg
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = None
        if cfg.lr_scheduler is not None:
            self.lr_scheduler = config.instantiate(
                cfg.lr_scheduler, optimizer=self.optimizer,
                num_training_steps=cfg.num_steps * cfg.ppo_epochs)

    def _generation_context(self) -> GenerationContext:
        lora = None
        if self.is_lora:
            lora = {"rank": int(self.cfg.model.lora_rank),
                    "alpha": float(self.cfg.model.lora_alpha)}
        return generation_context(
            self.cfg, self.checkpointer, self.dataset, max_seq_len=self.max_seq_len,
            device=self.device, dtype=self.dtype, world_size=self.world_size, rank=self.rank,
            allowed_tokens=self.allowed_tokens, lora=lora)
