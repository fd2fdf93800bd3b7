"""The GRPO training loop shared by the single-device and distributed recipes.

One GRPO step, as in ``docs/design.md``:

1. **Prompts**: each rank takes ``batch_size`` prompts from its shard of the dataset; a
   prompt's whole group stays on the rank that drew it.
2. **Rollout**: ``group_size`` completions per prompt, KV-cached, padded to uniform shapes,
   with the generation-time log-probs (:mod:`torchtune_grpo.rlhf.generation`).
3. **Score**: the weighted sum of the reward components (:mod:`torchtune_grpo.rlhf.rewards`).
4. **Advantage**: group-relative (:mod:`torchtune_grpo.rlhf.advantages`).
5. **Reference** log-probs, only when the loss has a KL term.
6. **Update**: ``ppo_epochs`` optimizer steps over shuffled micro-batches; every micro-batch
   loss is divided by the *global* normaliser, so micro-batching and the number of ranks do
   not change the update (:mod:`torchtune_grpo.rlhf.loss`).
7. **After the step**: metrics, step checkpoint, evaluation.

Single process (no torchrun) runs the same code with no process group and no FSDP.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from functools import partial
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchtune import config, training, utils
from torchtune.modules.peft import (
    disable_adapter,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
)

from torchtune_grpo import distributed as D
from torchtune_grpo.batching import StepBatches
from torchtune_grpo.checkpointing import (
    load_recipe_state,
    resolve_resume,
    save_step_checkpoint,
    weight_files,
)
from torchtune_grpo.config import check_input_files, per_rank_batch_size, validate_config
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.evaluation import EvalResult, EvalSettings, evaluate
from torchtune_grpo.modeling import DTYPES, build_model, has_adapters, meta_model, token_rules
from torchtune_grpo.rlhf.advantages import group_advantages, loss_token_mask
from torchtune_grpo.rlhf.forward import response_logprobs
from torchtune_grpo.rlhf.generation import (
    GenerationContext,
    NativeGenerator,
    decode_completions,
    mix_seeds,
)
from torchtune_grpo.rlhf.logprobs import auto_chunk_size
from torchtune_grpo.rlhf.loss import summarize_loss_stats
from torchtune_grpo.rlhf.reward_set import RewardOutput, build_reward_set
from torchtune_grpo.rlhf.trajectory import (
    Trajectory,
    attention_mask,
    concat_trajectories,
    position_ids,
)

log = utils.get_logger("INFO")

def _world_size_from_env() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank since the start, in GiB.

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only). CPU: the process's peak resident
    set size (:func:`~torchtune_grpo.memory.peak_rss_bytes`; Python, libraries and data
    included), the only peak the OS keeps.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    from torchtune_grpo.memory import peak_rss_bytes

    return peak_rss_bytes() / 1024**3


def split_batch(batch: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """Split a collated prompt batch into ``chunks`` equal consecutive parts.

    Prompt padding is recomputed per part (a part's prompts are left-padded to its own
    longest prompt); lists and per-prompt tensors are sliced alike.
    """
    if chunks == 1:
        return [batch]
    size = len(batch["answers"]) // chunks
    parts = []
    for i in range(chunks):
        sl = slice(i * size, (i + 1) * size)
        lengths = batch["prompt_lengths"][sl]
        width = int(lengths.max())
        parts.append({
            **{k: v[sl] for k, v in batch.items() if k not in ("tokens",)},
            "tokens": batch["tokens"][sl, batch["tokens"].shape[1] - width :],
        })
    return parts


def concat_reward_outputs(outputs: list[RewardOutput]) -> RewardOutput:
    """Concatenate the scores of consecutive chunks of one batch."""
    if len(outputs) == 1:
        return outputs[0]
    return RewardOutput(
        total=torch.cat([o.total for o in outputs]),
        components={k: torch.cat([o.components[k] for o in outputs])
                    for k in outputs[0].components},
        success=torch.cat([o.success for o in outputs]),
        errors={k: sum(o.errors.get(k, 0) for o in outputs) for k in outputs[0].errors},
    )


class GRPORecipe:
    """GRPO full fine-tuning on one or many ranks (see the module docstring for the step).

    Args:
        cfg: the merged config; validated before anything is built.
    """

    def __init__(self, cfg: DictConfig) -> None:
        validate_config(cfg, world_size=_world_size_from_env())
        self.cfg = cfg
        self.device = utils.get_device(cfg.get("device", "cuda"))
        self.dtype = DTYPES[cfg.get("dtype", "bf16")]
        self.world_size, self.rank = D.init_distributed(
            self.device, timeout_s=float(cfg.get("distributed_timeout_s", 600.0)))
        self.is_rank_zero = self.rank == 0
        self.seed = training.set_seed(cfg.get("seed", 0))
        self.batch_size = per_rank_batch_size(cfg, self.world_size)
        self.group_size = int(cfg.group_size)
        rows = self.batch_size * self.group_size
        self.forward_batch_size = int(cfg.get("forward_batch_size") or rows)
        self.max_generated_tokens = int(cfg.max_generated_tokens)
        self.temperature = float(cfg.get("temperature", 1.0))
        self.top_k = cfg.get("top_k")
        self.ppo_epochs = int(cfg.get("ppo_epochs", 1))
        self.grad_accum_steps = int(cfg.get("gradient_accumulation_steps", 1))
        self.mask_truncated = bool(cfg.get("mask_truncated_completions", False))
        self.exclude_zero_std = bool(cfg.get("exclude_zero_std_groups", False))
        self.num_steps = int(cfg.num_steps)
        self.save_every = cfg.get("save_every_n_steps")
        self.clip_grad_norm = cfg.get("clip_grad_norm")
        self.log_every = int(cfg.get("log_every_n_steps", 1))
        self.chunk_size = cfg.get("logprob_chunk_size")  # None: auto_chunk_size(V) in setup
        adv_cfg = cfg.get("advantages") or {}
        self.adv_scale = adv_cfg.get("scale", "group")
        self.adv_eps = float(adv_cfg.get("eps", 1e-6))
        self.step = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.max_consecutive_skips = int(cfg.get("max_consecutive_skipped_steps", 5))
        self._stop_requested = False
        self._adapter_state = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build data, rewards and loss first (cheap, validating), then the models."""
        cfg = self.cfg
        check_input_files(cfg)  # the base model is read even when resuming
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.dataset = config.instantiate(cfg.dataset, tokenizer=self.tokenizer)
        self.rewards = build_reward_set(cfg.rewards)
        self.loss_fn = config.instantiate(cfg.loss)
        self.generator = (config.instantiate(cfg.generator) if cfg.get("generator") is not None
                          else NativeGenerator())
        shape = meta_model(cfg.model)  # dims and adapters before any weight is loaded
        self.max_seq_len = getattr(shape, "max_seq_len", None)
        self._check_context_length(self.max_seq_len)
        self.batches = StepBatches(
            self.dataset, batch_size=self.batch_size, world_size=self.world_size,
            rank=self.rank, seed=self.seed, shuffle=bool(cfg.get("shuffle", True)),
            collate=partial(collate_prompts, pad_id=int(getattr(self.tokenizer, "pad_id", 0))),
        )
        self.eval_every = cfg.get("eval_every_n_steps")
        self.eval_dataset = None
        if cfg.get("eval_dataset") is not None:
            self.eval_dataset = config.instantiate(cfg.eval_dataset, tokenizer=self.tokenizer)
        eval_cfg = cfg.get("eval") or {}
        self.eval_settings = EvalSettings(
            num_samples=int(eval_cfg.get("num_samples", 1)),
            temperature=float(eval_cfg.get("temperature", 0.0)),
            top_k=eval_cfg.get("top_k"),
            k=list(eval_cfg.get("k", [1])),
            max_generated_tokens=int(eval_cfg.get("max_generated_tokens")
                                     or self.max_generated_tokens),
            forward_batch_size=int(eval_cfg.get("forward_batch_size")
                                   or self.forward_batch_size),
            seed=self.seed,
        )

        self.resume_dir = resolve_resume(cfg.get("resume_from_checkpoint", False),
                                         cfg.output_dir)
        self.is_lora = has_adapters(shape)
        del shape
        base_checkpointer = config.instantiate(cfg.checkpointer)
        adapter_state = None
        if self.resume_dir is not None and self.is_lora:
            # a LoRA step folder holds merged weights: rebuild base + adapters instead
            self.checkpointer = base_checkpointer
            state_dict = base_state = self.checkpointer.load_checkpoint()[training.MODEL_KEY]
            adapter_state = load_recipe_state(self.resume_dir)["adapter"]
        elif self.resume_dir is None:
            self.checkpointer = base_checkpointer
            state_dict = self.checkpointer.load_checkpoint()[training.MODEL_KEY]
            base_state = state_dict
        else:
            # the policy continues from the step folder; the reference stays the base model
            self.checkpointer = config.instantiate(
                cfg.checkpointer, checkpoint_dir=str(self.resume_dir),
                checkpoint_files=weight_files(self.resume_dir),
            )
            state_dict = self.checkpointer.load_checkpoint()[training.MODEL_KEY]
            base_state = (base_checkpointer.load_checkpoint()[training.MODEL_KEY]
                          if self.loss_fn.needs_reference else None)
        self.model = self._build_model(state_dict, trainable=True, adapter_state=adapter_state)
        if cfg.get("compile", False):
            training.compile_model(self.model, verbose=self.is_rank_zero)
        self.activation_offloading = training.get_act_offloading_ctx_manager(
            self.model, bool(cfg.get("enable_activation_offloading", False))
        )
        self.ref_model = (
            self._build_model(base_state, trainable=False)
            if self.loss_fn.needs_reference and not self.is_lora else None
        )
        del state_dict, base_state, adapter_state

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = config.instantiate(cfg.optimizer, trainable)
        self.lr_scheduler = None
        if cfg.get("lr_scheduler") is not None:
            self.lr_scheduler = config.instantiate(
                cfg.lr_scheduler,
                optimizer=self.optimizer,
                num_training_steps=self.num_steps * self.ppo_epochs,
            )
        if self.resume_dir is not None:
            self._load_recipe_state(load_recipe_state(self.resume_dir))
        self.metric_logger = None
        if self.is_rank_zero and cfg.get("metric_logger") is not None:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)

        self.rules = token_rules(self.tokenizer, self.model, self.device)
        self.allowed_tokens, self.logit_bias = self.rules.allowed, self.rules.logit_bias
        self.chunk_size = (auto_chunk_size(self.logit_bias.numel()) if self.chunk_size is None
                           else int(self.chunk_size))
        self.stop_tokens, self.pad_id = self.rules.stop_tokens, self.rules.pad_id
        self.generator.setup(self._generation_context())
        self.generator.sync_weights(self.model)  # a resumed or LoRA policy is not the base

    def _generation_context(self) -> GenerationContext:
        cfg = self.cfg
        lengths = getattr(self.dataset, "prompt_lengths", None)
        # longest sequence a rollout can make; the model's limit when the dataset cannot say
        max_len = (max(lengths) + self.max_generated_tokens if lengths
                   else int(self.max_seq_len or 4096))
        lora = None
        if self.is_lora:
            lora = {"rank": int(cfg.model.lora_rank), "alpha": float(cfg.model.lora_alpha)}
        return GenerationContext(
            model_dir=str(cfg.checkpointer.checkpoint_dir),
            model_type=self.checkpointer._model_type.name,
            hf_config=dict(getattr(self.checkpointer, "_config", None) or {}),
            device=self.device, dtype=self.dtype, world_size=self.world_size, rank=self.rank,
            max_len=max_len,
            allowed_tokens=self.allowed_tokens, lora=lora,
        )

    def _check_context_length(self, max_seq_len: int | None) -> None:
        """Longest prompt + ``max_generated_tokens`` must fit the model's ``max_seq_len``."""
        lengths = getattr(self.dataset, "prompt_lengths", None)
        if max_seq_len is None or not lengths:
            return
        need = max(lengths) + self.max_generated_tokens
        if need > max_seq_len:
            raise ValueError(
                f"config key 'max_generated_tokens' ({self.max_generated_tokens}) plus the "
                f"longest prompt ({max(lengths)} tokens) is {need}, above the model's "
                f"max_seq_len of {max_seq_len}: lower max_generated_tokens or set "
                "dataset.max_prompt_tokens"
            )

    def _build_model(self, state_dict: dict[str, torch.Tensor], *, trainable: bool,
                     adapter_state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        cfg = self.cfg
        return build_model(
            cfg.model, state_dict, device=self.device, dtype=self.dtype,
            world_size=self.world_size, trainable=trainable, adapter_state_dict=adapter_state,
            activation_checkpointing=cfg.get("enable_activation_checkpointing", False),
            fsdp_cpu_offload=cfg.get("fsdp_cpu_offload", False),
            reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True),
        )

    # ------------------------------------------------------------------ one step
    def rollout(self, batch: dict[str, Any]) -> Trajectory:
        """Step 2: ``group_size`` completions per prompt, padded to uniform shapes.

        Each completion's random numbers derive from ``(seed, step, prompt index, sample
        index)`` alone, so the same global batch yields the same rollouts on any number of
        ranks and with any ``forward_batch_size``, and a resumed run repeats them exactly.
        """
        tokens = batch["tokens"].to(self.device)
        # left padding is the only padding (a prompt may itself contain pad_id)
        lengths = batch["prompt_lengths"].to(self.device)
        prompt_mask = torch.arange(tokens.shape[1], device=self.device)[None, :] >= (
            tokens.shape[1] - lengths[:, None]
        )
        self.model.eval()
        traj = self.generator.generate(
            self.model,
            tokens,
            prompt_mask,
            group_size=self.group_size,
            forward_batch_size=self.forward_batch_size,
            max_generated_tokens=self.max_generated_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            stop_tokens=self.stop_tokens,
            pad_id=self.pad_id,
            logit_bias=self.logit_bias,
            prompt_seeds=mix_seeds(self.seed, self.step, batch["indices"]),
            all_done=partial(D.all_ranks_true, device=self.device),
            cache_dtype=self.dtype,
        )
        self.model.train()
        return traj

    @torch.no_grad()
    def policy_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """``[N, T]`` log-probs of the rollout under the current policy (no graph).

        Used as the "old" log-probs when the generator's own cannot be (see
        ``needs_policy_logprobs`` of the generator, e.g. vLLM with ``top_k``).
        """
        return self._response_logprobs(self.model, traj) * traj.response_mask

    def _response_logprobs(self, model: nn.Module, traj: Trajectory) -> torch.Tensor:
        """``[N, T]`` log-probs of ``traj``'s responses under ``model``, micro-batch by
        micro-batch (call under ``torch.no_grad``)."""
        mask, pos = self._forward_inputs(traj)
        out = []
        for i in range(0, traj.num_sequences, self.forward_batch_size):
            sl = slice(i, i + self.forward_batch_size)
            lp, _ = response_logprobs(
                model, traj.tokens[sl], prompt_len=traj.prompt_len, mask=mask[sl],
                input_pos=pos[sl], temperature=self.temperature, logit_bias=self.logit_bias,
                chunk_size=self.chunk_size,
            )
            out.append(lp)
        return torch.cat(out)

    def score(self, traj: Trajectory, batch: dict[str, Any]):
        """Step 3: decode completions and apply the reward components."""
        completions = decode_completions(self.tokenizer, traj, self.allowed_tokens)
        repeat = self.group_size
        answers = [a for a in batch["answers"] for _ in range(repeat)]
        questions = [q for q in batch["questions"] for _ in range(repeat)]
        out = self.rewards(
            completions,
            answers,
            questions=questions,
            stopped=traj.stopped.tolist(),
            response_lengths=traj.response_lengths.tolist(),
            max_generated_tokens=self.max_generated_tokens,
        )
        return completions, out

    def _forward_inputs(self, traj: Trajectory) -> tuple[torch.Tensor, torch.Tensor]:
        padding = traj.padding_mask
        return attention_mask(padding), position_ids(padding)

    @torch.no_grad()
    def reference_logprobs(self, traj: Trajectory) -> torch.Tensor:
        """Step 5: ``[N, T]`` log-probs of the responses under the frozen reference model.

        With LoRA the reference is the policy itself with its adapters disabled: no second
        copy of the weights exists.
        """
        model = self.model if self.is_lora else self.ref_model
        context = disable_adapter(self.model) if self.is_lora else contextlib.nullcontext()
        with context:
            return self._response_logprobs(model, traj)

    def update(self, traj: Trajectory, advantages: torch.Tensor,
               ref_logprobs: torch.Tensor | None,
               loss_mask: torch.Tensor | None = None,
               old_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Step 6: ``ppo_epochs`` optimizer steps on this rollout; returns loss metrics.

        Args:
            traj: the rollout.
            advantages: ``[N]``.
            ref_logprobs: ``[N, T]`` reference log-probs, or None without a KL term.
            loss_mask: ``[N, T]`` tokens that count (default: every response token).
            old_logprobs: ``[N, T]`` log-probs of the sampling policy (default: the generator's,
                ``traj.logprobs``).

        Besides the loss metrics, ``generation/logprob_diff_max`` and ``_mean`` compare the
        generator's log-probs with the policy's own in the first epoch (before any optimizer
        step: the same weights), over response tokens: ~1e-6 for the native engine in fp32,
        larger for another engine or precision, and large when its weights were not synced.
        """
        old = traj.logprobs if old_logprobs is None else old_logprobs
        mask, pos = self._forward_inputs(traj)
        response_mask = traj.response_mask if loss_mask is None else loss_mask
        normalizer = self.loss_fn.normalizer_contribution(response_mask).to(
            self.device, torch.float32
        )
        normalizer = D.all_reduce(normalizer.clone(), "sum")
        stats, grad_norms, skipped = [], [], 0
        gap = torch.zeros(3, dtype=torch.float64, device=self.device)  # max, sum, count
        for epoch in range(self.ppo_epochs):
            # micro-batch order: a pure function of (seed, step, epoch, rank), like sampling
            gen = torch.Generator().manual_seed(
                int(mix_seeds(self.seed, self.step, epoch, self.rank, 0x5F0F))
            )
            order = torch.randperm(traj.num_sequences, generator=gen)
            for i in range(0, traj.num_sequences, self.forward_batch_size):
                idx = order[i : i + self.forward_batch_size].to(self.device)
                with self.activation_offloading:
                    logprobs, entropy = response_logprobs(
                        self.model, traj.tokens[idx], prompt_len=traj.prompt_len,
                        mask=mask[idx], input_pos=pos[idx], temperature=self.temperature,
                        logit_bias=self.logit_bias, chunk_size=self.chunk_size,
                        return_entropy=True, entropy_grad=self.loss_fn.needs_entropy,
                    )
                if epoch == 0:
                    diff = (logprobs.detach() - traj.logprobs[idx]).abs()[traj.response_mask[idx]]
                    if diff.numel():
                        gap[0] = torch.maximum(gap[0], diff.max().double())
                        gap[1] += diff.double().sum()
                        gap[2] += diff.numel()
                loss, mb_stats = self.loss_fn(
                    logprobs,
                    old[idx],
                    advantages[idx],
                    response_mask[idx],
                    normalizer=normalizer,
                    ref_logprobs=None if ref_logprobs is None else ref_logprobs[idx],
                    entropy=entropy,
                )
                # FSDP averages gradients over ranks; the loss is already a global mean.
                (loss * self.world_size).backward()
                stats.append(mb_stats)
            grad_norm = self._grad_norm()
            if math.isfinite(grad_norm):
                self.optimizer.step()
                self.consecutive_skips = 0
            else:
                skipped += 1
                self.skipped_steps += 1
                self.consecutive_skips += 1
                log.warning(f"step {self.step + 1}: non-finite loss or gradient, update skipped "
                            f"({self.consecutive_skips} in a row)")
            self.optimizer.zero_grad(set_to_none=True)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            grad_norms.append(grad_norm)
        metrics = summarize_loss_stats(stats, all_reduce=lambda t, op: D.all_reduce(t, op))
        gap_max = D.all_reduce(gap[:1].clone(), "max")
        gap_sum = D.all_reduce(gap[1:].clone(), "sum")
        metrics["generation/logprob_diff_max"] = float(gap_max[0])
        metrics["generation/logprob_diff_mean"] = float(gap_sum[0] / gap_sum[1].clamp(min=1))
        metrics["grad_norm"] = float(sum(grad_norms) / len(grad_norms))
        metrics["skipped_steps"] = float(self.skipped_steps)
        return metrics

    def _grad_norm(self) -> float:
        max_norm = float(self.clip_grad_norm) if self.clip_grad_norm else float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ------------------------------------------------------------------ metrics
    def _global_mean(self, values: torch.Tensor) -> float:
        t = torch.tensor([values.float().sum().item(), values.numel()], dtype=torch.float64,
                         device=self.device)
        D.all_reduce(t, "sum")
        return float(t[0] / t[1])

    def _step_metrics(self, traj, rewards_out, adv_out, loss_metrics, times) -> dict[str, float]:
        total = rewards_out.total.float()
        mean = self._global_mean(total)
        mean_sq = self._global_mean(total * total)
        metrics = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(mean_sq - mean * mean, 0.0)),
            "success_rate": self._global_mean(rewards_out.success.float()),
            "response_length/mean": self._global_mean(traj.response_lengths.float()),
            "truncated_fraction": self._global_mean((~traj.stopped).float()),
            "zero_std_group_fraction": self._global_mean(adv_out.zero_std_groups.float()),
        }
        for name, values in rewards_out.components.items():
            metrics[f"reward/{name}"] = self._global_mean(values.float())
        for name, count in rewards_out.errors.items():
            errors = D.all_reduce(torch.tensor([float(count)], device=self.device), "sum")
            metrics[f"reward/{name}/errors"] = float(errors)
        metrics["data/skipped_rows"] = float(getattr(self.dataset, "skipped_rows", 0))
        metrics.update(loss_metrics)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        generated = torch.tensor([float(traj.response_mask.sum())], device=self.device)
        D.all_reduce(generated, "sum")
        metrics["tokens_per_second/generation"] = float(generated) / max(times["generation"], 1e-9)
        for key, value in times.items():
            metrics[f"time/{key}"] = value
        if self.cfg.get("log_peak_memory_stats", True):
            metrics["peak_memory_gb"] = peak_memory_gib(self.device)
        return metrics

    # ------------------------------------------------------------------ loop
    def train(self) -> None:
        """Run ``num_steps`` GRPO steps (see the module docstring)."""
        from tqdm import tqdm

        show = self.is_rank_zero and self.cfg.get("progress_bar", True)
        if self.eval_dataset is not None and self.step == 0 and self.cfg.get("eval_at_start", True):
            self.run_eval()
        progress = tqdm(total=self.num_steps, initial=self.step, disable=not show)
        previous_handler = signal.signal(signal.SIGTERM, self._request_stop)
        try:
            self._train_loop(progress)
        finally:
            signal.signal(signal.SIGTERM, previous_handler)
            progress.close()

    def _request_stop(self, signum, _frame) -> None:
        """SIGTERM (preemption): finish the current step, save, and stop."""
        log.warning(f"received signal {signum}: saving at the end of this step, then stopping")
        self._stop_requested = True

    def _train_loop(self, progress) -> None:
        while self.step < self.num_steps:
            batch = self.batches.batch(self.step)
            times = {"generation": 0.0, "scoring": 0.0}
            trajs, scores = [], []
            # gradient accumulation: roll out and score the batch in sequential chunks; the
            # update below still sees the whole batch, so the result equals one chunk of B
            for chunk in split_batch(batch, self.grad_accum_steps):
                t0 = time.perf_counter()
                trajs.append(self.rollout(chunk))
                times["generation"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                scores.append(self.score(trajs[-1], chunk)[1])
                times["scoring"] += time.perf_counter() - t0
            traj = concat_trajectories(trajs)
            rewards_out = concat_reward_outputs(scores)

            t0 = time.perf_counter()
            rewards_out.total = rewards_out.total.to(self.device)
            adv_out = group_advantages(rewards_out.total, self.group_size,
                                       scale=self.adv_scale, eps=self.adv_eps)
            times["scoring"] += time.perf_counter() - t0

            self.generator.before_update()  # e.g. vLLM frees its KV cache for the update
            t0 = time.perf_counter()
            ref = self.reference_logprobs(traj) if self.loss_fn.needs_reference else None
            old = (self.policy_logprobs(traj)
                   if self.generator.needs_policy_logprobs(top_k=self.top_k) else None)
            times["reference"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            loss_mask = loss_token_mask(
                traj.response_mask, traj.stopped, adv_out.zero_std_groups.to(self.device),
                mask_truncated_completions=self.mask_truncated,
                exclude_zero_std_groups=self.exclude_zero_std,
            )
            loss_metrics = self.update(traj, adv_out.advantages.to(self.device), ref, loss_mask,
                                       old_logprobs=old)
            times["update"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            self.generator.sync_weights(self.model)  # no-op for the native engine
            times["weight_sync"] = time.perf_counter() - t0
            self.step += 1

            metrics = self._step_metrics(traj, rewards_out, adv_out, loss_metrics, times)
            self.last_metrics = metrics
            if self.metric_logger is not None and self.step % self.log_every == 0:
                self.metric_logger.log_dict(metrics, step=self.step)
            progress.update(1)
            progress.set_description(
                f"step {self.step} reward {metrics['reward/mean']:.3f} "
                f"success {metrics['success_rate']:.2f}"
            )
            preempted = not D.all_ranks_true(not self._stop_requested, self.device)
            diverged = self.consecutive_skips >= self.max_consecutive_skips
            last = self.step == self.num_steps
            evaluated = None
            if self.eval_every and (self.step % self.eval_every == 0 or last):
                evaluated = self.run_eval()
            if last or preempted or diverged or evaluated is not None or (
                self.save_every and self.step % self.save_every == 0
            ):
                self.save_checkpoint(evaluated)
            if preempted:
                log.warning(f"stopped after step {self.step} on request; resume with "
                            "resume_from_checkpoint=true")
                break
            if diverged:
                raise RuntimeError(
                    f"{self.consecutive_skips} consecutive steps had a non-finite loss or "
                    f"gradient (max_consecutive_skipped_steps={self.max_consecutive_skips}); "
                    f"saved step_{self.step} and stopped. Lower the learning rate, check the "
                    "rewards, or resume from an earlier checkpoint."
                )

    def run_eval(self) -> EvalResult:
        """Evaluate the current policy on ``eval_dataset``; log ``eval/...`` metrics."""
        result = evaluate(
            self.model, self.tokenizer, self.eval_dataset, self.rewards, self.eval_settings,
            device=self.device, logit_bias=self.logit_bias, allowed_tokens=self.allowed_tokens,
            stop_tokens=self.stop_tokens, pad_id=self.pad_id, cache_dtype=self.dtype,
        )
        metrics = {f"eval/{k}": v for k, v in result.metrics.items()}
        metrics["eval/problems_per_second"] = len(result.samples) / max(result.seconds, 1e-9)
        if self.metric_logger is not None:
            self.metric_logger.log_dict(metrics, step=self.step)
        if self.is_rank_zero:
            log.info(f"step {self.step}: " + ", ".join(
                f"{k}={v:.4f}" for k, v in metrics.items()))
        return result

    # ------------------------------------------------------------------ checkpoint
    def _full_model_state_dict(self) -> dict[str, torch.Tensor]:
        if self.world_size > 1:
            return training.gather_cpu_state_dict(self.model, self.is_rank_zero, self.device)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def _lora_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Adapters (PEFT format via the checkpointer) plus, unless
        ``save_adapter_weights_only``, the merged weights that ``transformers`` loads."""
        m = self.cfg.model
        adapter = get_adapter_state_dict(state)
        checkpoint: dict[str, Any] = {
            training.ADAPTER_KEY: adapter,
            training.ADAPTER_CONFIG: {
                "r": m.lora_rank,
                "lora_alpha": m.lora_alpha,
                "target_modules": get_lora_module_names(
                    list(m.lora_attn_modules), m.get("apply_lora_to_mlp", False),
                    m.get("apply_lora_to_output", False),
                ),
                "peft_type": "LORA",
            },
        }
        if not self.cfg.get("save_adapter_weights_only", False):
            checkpoint[training.MODEL_KEY] = get_merged_lora_ckpt(
                dict(state), rank=m.lora_rank, alpha=m.lora_alpha
            )
        return checkpoint

    def _full_optimizer_state_dict(self) -> dict[str, Any]:
        if self.world_size > 1:  # gathered on rank 0 (a collective: every rank calls it)
            return training.get_full_optimizer_state_dict(
                self.model, self.optimizer, self.is_rank_zero, device=self.device
            )
        return self.optimizer.state_dict()

    def recipe_state(self, optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """What the next step reads, for ``recipe_state.pt``.

        Sampling, prompt order and micro-batch order are pure functions of ``(seed, step)``,
        so no random-generator state needs saving: the step, the optimizer and the scheduler
        are the whole state.
        """
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch_size": self.batch_size * self.world_size,
            "world_size": self.world_size,
            "optimizer": optimizer_state,
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "adapter": self._adapter_state,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
        }

    def _load_recipe_state(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"resume_from_checkpoint: {self.resume_dir} was trained with seed "
                f"{state['seed']}, the config says {self.seed}; an exact resume needs the same seed"
            )
        if state["global_batch_size"] != self.batch_size * self.world_size:
            log.warning(
                f"resuming with a global batch of {self.batch_size * self.world_size} prompts "
                f"instead of {state['global_batch_size']}: later steps see other prompts"
            )
        if self.world_size > 1:
            training.load_from_full_optimizer_state_dict(
                self.model, self.optimizer, state["optimizer"], self.device
            )
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.is_rank_zero:
            log.info(f"resumed from {self.resume_dir} at step {self.step}")

    def save_checkpoint(self, evaluated: EvalResult | None = None) -> None:
        """Write ``output_dir/step_{step}`` (rank 0 writes, every rank takes part).

        Args:
            evaluated: evaluation results of this step, stored inside the folder.
        """
        state = self._full_model_state_dict()
        optimizer_state = self._full_optimizer_state_dict()
        self._adapter_state = None
        if self.is_rank_zero:
            checkpoint = {training.MODEL_KEY: state}
            if self.is_lora:
                checkpoint = self._lora_checkpoint(state)
                self._adapter_state = checkpoint[training.ADAPTER_KEY]
            extra = None
            if evaluated is not None:
                extra = evaluated.files(
                    dataset=str(self.cfg.eval_dataset.get("_component_")),
                    split=str(self.cfg.eval_dataset.get("split", "")),
                    model_path=str(self.cfg.output_dir) + f"/step_{self.step}",
                    step=self.step,
                )
            path = save_step_checkpoint(
                output_dir=self.cfg.output_dir,
                step=self.step,
                checkpointer=self.checkpointer,
                checkpoint=checkpoint,
                adapter_only=self.is_lora and bool(self.cfg.get("save_adapter_weights_only")),
                recipe_state=self.recipe_state(optimizer_state),
                extra_files=extra,
                keep_last_n=self.cfg.get("keep_last_n_checkpoints"),
            )
            log.info(f"saved {path}")
        D.barrier()

    def cleanup(self) -> None:
        """Close the generator, the metric logger and the process group."""
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.close()
        if self.metric_logger is not None:
            self.metric_logger.close()
        D.destroy()
