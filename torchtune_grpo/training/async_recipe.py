"""Asynchronous GRPO: rollout ranks generate while trainer ranks train (``docs/async.md``).

One torchrun world of ``N`` processes, two roles:

* **Trainer ranks** (``0 .. T-1``, ``T = N - rollout_ranks``) run the synchronous step
  (:class:`~torchtune_grpo.training.recipe.GRPORecipe`) unchanged, FSDP2-sharded over their own
  group, with another rollout source, :class:`AsyncRolloutSource`: its generator,
  :class:`RemoteRollouts`, *receives* each rollout and sends weights.
* **Rollout ranks** (``T .. N-1``) each hold the whole policy and one engine
  (:class:`RolloutWorker`, sharing :class:`~torchtune_grpo.rollout.runtime.RolloutRuntime`);
  rollout rank ``T + j % R`` generates trainer rank ``j``'s share of the global batch.

**Staleness.** The batch of step ``t`` is sampled by policy version ``max(0, t - k)``
(``max_staleness: k``), whatever the timing: a run is reproducible and ``k = 0`` is the
synchronous algorithm bit for bit. Transport: :mod:`torchtune_grpo.training.async_transport`;
the weight-sync proof, resume and the measurements: ``docs/async.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchtune import config, training, utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.backends import backend_for
from torchtune_grpo.config.schema import ASYNC_KEYS, RECIPE_KEYS, per_rank_batch_size, with_defaults
from torchtune_grpo.config.validation import check_device, check_input_files, validate_async_config
from torchtune_grpo.datasets import collate_prompts
from torchtune_grpo.policy.model import DTYPES, build_model, token_rules
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import GenerationContext, GenerationRequest, Generator
from torchtune_grpo.rollout.runtime import (
    RolloutRuntime,
    check_context_length,
    generation_context,
)
from torchtune_grpo.training.async_transport import (
    AsyncWorld,
    PayloadChannel,
    RolloutVersions,
    VersionStore,
    WeightReceiver,
    WeightSender,
    behavior_version,
    full_tensor,
    init_world,
    last_sent_version,
    recv_rollout,
)
from torchtune_grpo.training.batching import StepBatches, split_batch
from torchtune_grpo.training.interrupts import StopSignals, signals_only_logged
from torchtune_grpo.training.parts import failures_reported_first, world_size_from_env
from torchtune_grpo.training.recipe import GRPORecipe
from torchtune_grpo.training.update import PolicyUpdate

log = utils.get_logger("INFO")

__all__ = [
    "AsyncRolloutSource",
    "RemoteRollouts",
    "RolloutWorker",
    "run_async_recipe",
]


def _validate_async(cfg: DictConfig) -> None:
    """The async config checks for torchrun's world size, and the device exists here."""
    validate_async_config(cfg, world_size=world_size_from_env())
    check_device(with_defaults(cfg, {**RECIPE_KEYS, **ASYNC_KEYS}).device)


# ---------------------------------------------------------------------------- trainer side
class RemoteRollouts(Generator):
    """The trainer ranks' generator: each rollout arrives from a rollout rank.

    :meth:`begin_step` names the step; :meth:`generate` receives the next rollout of this
    rank's shard and checks it is the one expected (step, chunk, policy version, prompts);
    :meth:`sync_weights` keeps each new version and sends it when a rollout rank needs it.

    Args:
        world: the process groups and roles.
        versions: the trainer's store of policy versions (shared with
            :class:`AsyncRolloutSource`, which checkpoints them and measures the behaviour gap
            with them).
        max_staleness: ``k``: the batch of step ``t`` is sampled by version ``max(0, t - k)``.
        num_steps: the run's last step (no version is sent that no batch needs).
        engine_needs_policy_logprobs: what the rollout ranks' engine answers to
            ``needs_policy_logprobs``.
        on_start: called with the model by the first :meth:`sync_weights` (the end of setup)
            instead of a send: the handshake that starts the rollout ranks.
        output_dir: the run's output folder (named if a rollout rank dies).
    """

    def __init__(self, world: AsyncWorld, versions: VersionStore, *, max_staleness: int,
                 num_steps: int, engine_needs_policy_logprobs: bool,
                 on_start: Callable[[nn.Module], None], output_dir: str = "") -> None:
        self.world = world
        self.output_dir = output_dir
        self.versions = versions
        self.max_staleness = max_staleness
        self.num_steps = num_steps
        self.engine_needs_policy_logprobs = engine_needs_policy_logprobs
        self.on_start = on_start
        self.channel = PayloadChannel(world.payload_group)
        self.sender = WeightSender(world.roles, world.weight_control, world.weight_data,
                                   is_sender=world.rank == 0)
        self.source = world.roles.rollout_rank_of(world.rank)
        self.step = 0
        self.chunk = 0
        self.started = False
        self.received: list[dict[str, Any]] = []  # this step's messages (timings, versions)
        self.wait_s = 0.0
        self.sync_bytes = 0

    def setup(self, context: GenerationContext) -> None:
        """Nothing to build: the engines live on the rollout ranks."""

    def begin_step(self, step: int) -> None:
        """The rollouts received and the weights sent next belong to ``step``."""
        self.step = step

    def generate(self, model: nn.Module, request: GenerationRequest) -> Trajectory:
        """Receive the rollout of ``request.prompt_tokens`` ``[B, P]`` made by this shard's
        rollout rank; raise if it is not the step, chunk, version and prompts expected."""
        prompt_tokens = request.prompt_tokens
        start = time.perf_counter()
        message = recv_rollout(self.channel, self.source, self.step + 1, self.output_dir)
        self.wait_s += time.perf_counter() - start
        step = self.step
        expected = (step, self.chunk, behavior_version(step, self.max_staleness))
        got = (message["step"], message["chunk"], message["version"])
        if got != expected:
            raise RuntimeError(f"rank {self.world.rank}: expected the rollout of (step, chunk, "
                               f"version) {expected} from rank {self.source}, got {got}")
        traj = Trajectory(**{k: v.to(prompt_tokens.device) if isinstance(v, torch.Tensor)
                             else v for k, v in message["trajectory"].items()})
        group = int(request.group_size)
        sent_prompts = traj.tokens[::group, : traj.prompt_len]
        if not (sent_prompts.shape == prompt_tokens.shape
                and torch.equal(sent_prompts, prompt_tokens)):
            raise RuntimeError(f"rank {self.world.rank}: the rollout of step {step} from rank "
                               f"{self.source} is for other prompts than this rank's batch")
        self.chunk += 1
        self.received.append(message)
        return traj

    def needs_policy_logprobs(self, *, top_k: int | None) -> bool:
        """The rollout ranks' engine decides (native: its log-probs are exact)."""
        return bool(self.engine_needs_policy_logprobs)

    def before_update(self) -> None:
        """Nothing: no engine memory lives here."""

    def sync_weights(self, model: nn.Module) -> None:
        """After the update of the current step: keep the new version, send it when a rollout
        rank will need it, and forget versions no future batch was sampled by. The first call
        (the end of setup) runs ``on_start`` instead."""
        if not self.started:
            self.started = True
            self.on_start(model)
            return
        version, k = self.step + 1, self.max_staleness
        self.versions.keep(model, version)
        self.versions.prune(behavior_version(version, k))
        if version <= last_sent_version(self.num_steps, k):
            self.sync_bytes += self.sender.send(model, version)

    def pop_step(self) -> tuple[list[dict[str, Any]], float, int]:
        """This step's received messages, seconds waited for them and weight bytes sent; resets
        them for the next step."""
        out = (self.received, self.wait_s, self.sync_bytes)
        self.received, self.wait_s, self.sync_bytes, self.chunk = [], 0.0, 0, 0
        return out

    def finish(self) -> None:
        """Stop the rollout ranks and take what they still send (every trainer rank)."""
        self.sender.stop()
        while True:
            message = recv_rollout(self.channel, self.source, self.step + 1, self.output_dir)
            if message.get("final"):
                break
        self.sender.wait_sent()

    def close(self) -> None:
        """Nothing to free."""


class AsyncRolloutSource:
    """A trainer rank's rollout source (:class:`~torchtune_grpo.training.parts.RolloutSource`):
    the trainer ranks' process group and FSDP2 mesh, :class:`RemoteRollouts` as the generator,
    the policy versions in the recipe state, the behaviour gap of stale batches and the
    asynchronous metrics (``docs/metrics.md``).

    Args:
        world: the process groups and roles.
        max_staleness: ``k``: the batch of step ``t`` is sampled by version ``max(0, t - k)``.
        num_steps: the run's last step.
    """

    extra_keys = ASYNC_KEYS

    def __init__(self, world: AsyncWorld, *, max_staleness: int, num_steps: int) -> None:
        self.world = world
        self.max_staleness = max_staleness
        self.num_steps = num_steps
        self.versions = VersionStore()
        self.remote: RemoteRollouts | None = None
        self.entries: RolloutVersions | None = None
        self.audit: tuple[float, float] | None = None

    def validate(self, cfg: DictConfig) -> None:
        """Nothing: :func:`run_async_recipe` checked the config before the process group
        existed."""

    def process_group(self, device: torch.device, timeout_s: float) -> D.Ranks:
        """The trainer ranks' group: every collective of the step reaches these ranks only."""
        return D.Ranks(self.world.trainer_group)

    def device_mesh(self, ranks: D.Ranks, device: torch.device) -> Any:
        """FSDP2 shards over the trainer ranks (None for one trainer rank)."""
        if self.world.roles.trainer_ranks > 1:
            from torch.distributed.device_mesh import DeviceMesh

            return DeviceMesh.from_group(self.world.trainer_group, device.type)
        return None

    def generator(self, engine: Generator, cfg: DictConfig) -> Generator:
        """:class:`RemoteRollouts`; the engine itself (``generator:``) is built on the rollout
        ranks, only asked here whether its log-probs can serve as the sampling policy's (never
        outside float32: the rollout ranks' decode rounds differently from the update)."""
        needs_policy_logprobs = (bool(engine.needs_policy_logprobs(top_k=cfg.top_k))
                                 or cfg.dtype != "fp32")
        engine.close()
        self.remote = RemoteRollouts(self.world, self.versions,
                                     max_staleness=self.max_staleness, num_steps=self.num_steps,
                                     engine_needs_policy_logprobs=needs_policy_logprobs,
                                     on_start=self.start_rollouts, output_dir=cfg.output_dir)
        return self.remote

    def model_state(self, model: nn.Module, ranks: D.Ranks,
                    device: torch.device) -> dict[str, torch.Tensor]:
        """The full state dict on trainer rank 0, gathered over the trainer ranks only
        (torchtune's ``gather_cpu_state_dict`` ends each parameter with a barrier of the whole
        world, which the rollout ranks never join)."""
        out = {}
        for name, value in model.state_dict().items():
            full = full_tensor(value)
            if ranks.rank() == 0:
                out[name] = full.cpu().clone()
        return out

    def state_entries(self, model: nn.Module, ranks: D.Ranks) -> RolloutVersions:
        """:class:`RolloutVersions` of ``model``."""
        self.entries = RolloutVersions(model, self.versions, max_staleness=self.max_staleness,
                                       rollout_ranks=self.world.roles.rollout_ranks,
                                       is_rank_zero=ranks.rank() == 0)
        return self.entries

    def start_rollouts(self, model: nn.Module) -> None:
        """Tell the rollout ranks where to start and send the versions they need first:
        versions ``max(1, s - k) .. s`` for a run resumed at step ``s`` (the older ones from
        the checkpoint); a fresh run sends none (the rollout ranks start from the base)."""
        k, s = self.max_staleness, self.entries.start_step
        names = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
        if self.world.rank == 0:
            box = [{"start_step": s, "names": names}]
            dist.broadcast_object_list(box, src=0, group=self.world.weight_control)
        for version, state in self.entries.resumed.items():
            self.versions.keep_full(model, version, state)
        self.versions.keep(model, s)
        last = last_sent_version(self.num_steps, k)
        for version in range(max(1, behavior_version(s, k)), min(s, last) + 1):
            if version == s:
                self.remote.sender.send(model, version)
            else:
                full = self.versions.gathered(model, version, keep=True)
                self.remote.sender.send_full(version, list(full.values()))
        self.entries.resumed = {}

    def behavior_is_current(self, step: int) -> bool:
        """Whether the batch of ``step`` was sampled by the weights of ``step``."""
        return behavior_version(step, self.max_staleness) == step

    def begin_step(self, step: int) -> None:
        """The rollouts received next belong to ``step``."""
        self.audit = None
        self.remote.begin_step(step)

    def after_rollout(self, traj: Trajectory, step: int, update: PolicyUpdate) -> None:
        """For a stale batch, measure the engine/trainer log-prob gap of its first
        micro-batch under the behaviour version's weights."""
        if not self.behavior_is_current(step) and len(self.remote.received) == 1:
            self.audit = self._behavior_gap(traj, step, update)

    @torch.no_grad()
    def _behavior_gap(self, traj: Trajectory, step: int,
                      update: PolicyUpdate) -> tuple[float, float]:
        """``(max, mean)`` over the trainer ranks of ``|engine log-prob - trainer log-prob|``
        of the first micro-batch's response tokens, the trainer's under the behaviour
        version."""
        version = behavior_version(step, self.max_staleness)
        model, device = update.model, update.device
        rows = slice(0, min(update.settings.forward_batch_size, traj.num_sequences))
        with self.versions.swapped_in(model, version), update.gathered(model):
            model.eval()
            logprobs, _ = update.micro_batch_logprobs(model, traj, rows)
            model.train()
        diff = (logprobs - traj.logprobs[rows]).abs()[traj.response_mask[rows]].double()
        stats = torch.tensor([diff.max() if diff.numel() else 0.0], dtype=torch.float64,
                             device=device)
        sums = torch.tensor([diff.sum(), diff.numel()], dtype=torch.float64, device=device)
        update.ranks.all_reduce(stats, "max")
        update.ranks.all_reduce(sums, "sum")
        return float(stats[0]), float(sums[0] / sums[1].clamp(min=1))

    def step_metrics(self, step: int, metrics: dict[str, float], ranks: D.Ranks,
                     device: torch.device) -> None:
        """The behaviour gap of a stale batch, ``staleness/mean``, ``async/...`` and
        ``weight_sync/...`` (sums over the trainer ranks, a collective)."""
        if self.audit is not None:
            metrics["generation/logprob_diff_max"], metrics["generation/logprob_diff_mean"] = (
                self.audit)
        messages, wait_s, sync_bytes = self.remote.pop_step()
        gen_s = sum(float(m["timing"]["generate_s"]) for m in messages)
        idle_s = sum(float(m["timing"]["weight_wait_s"]) for m in messages)
        t = torch.tensor([gen_s, idle_s, wait_s, float(sync_bytes)], dtype=torch.float64,
                         device=device)
        ranks.all_reduce(t, "sum")
        rollout_ranks, trainers = self.world.roles.rollout_ranks, self.world.roles.trainer_ranks
        metrics.update({
            "staleness/mean": float(step - behavior_version(step, self.max_staleness)),
            "async/rollout_generate_s": float(t[0]) / rollout_ranks,
            "async/rollout_weight_wait_s": float(t[1]) / rollout_ranks,
            "async/trainer_wait_s": float(t[2]) / trainers,
            "weight_sync/bytes": float(t[3]),
            "weight_sync/seconds": metrics.get("time/weight_sync", 0.0),
        })

    def finish(self) -> None:
        """Stop the rollout ranks and take what they still send."""
        self.remote.finish()


# ---------------------------------------------------------------------------- rollout side
class RolloutWorker:
    """A rollout rank: the whole policy, unsharded, and one engine; generates the batches of
    its trainer shards with the version each step is due (see the module docstring).

    Not a recipe: it builds the tokenizer, the data, the policy and the engine, and samples
    through the same :class:`~torchtune_grpo.rollout.runtime.RolloutRuntime` as the recipe,
    with this process alone as its ranks (no collective reaches another rank from inside a
    rollout).

    Args:
        cfg: the config (validated by :func:`run_async_recipe`).
        world: the process groups and roles.
    """

    def __init__(self, cfg: DictConfig, world: AsyncWorld) -> None:
        self.world = world
        self.cfg = cfg = with_defaults(cfg, {**RECIPE_KEYS, **ASYNC_KEYS})
        self.device = utils.get_device(cfg.device)
        backend_for(self.device).configure_process(keep_freed_memory=cfg.keep_freed_cpu_memory)
        self.dtype = DTYPES[cfg.dtype]
        self.seed = D.set_seed(cfg.seed)
        roles = world.roles
        self.group_size = int(cfg.group_size)
        self.batch_size = per_rank_batch_size(cfg, roles.trainer_ranks)
        self.forward_batch_size = int(cfg.forward_batch_size
                                      or self.batch_size * self.group_size)
        self.shards = roles.shards_of(world.rank)
        self.generator: Generator | None = None

    def setup(self) -> None:
        """Tokenizer, data, the policy (base weights, one device) and the engine."""
        cfg = self.cfg
        check_input_files(cfg)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.dataset = config.instantiate(cfg.dataset, tokenizer=self.tokenizer)
        self.generator = (config.instantiate(cfg.generator) if cfg.generator is not None
                          else NativeGenerator())
        if (isinstance(self.generator, NativeGenerator)
                and "packed_weights" not in (cfg.generator or {})):
            # the synchronous recipe on several ranks decodes with F.linear (no packed weights
            # on FSDP2 models); so do the rollout ranks unless the config asks, so that
            # max_staleness: 0 samples bit for bit what that recipe samples
            self.generator.packed_weights = False
        checkpointer = config.instantiate(cfg.checkpointer)
        state = checkpointer.load_checkpoint()[training.MODEL_KEY]
        self.model = build_model(cfg.model, state, device=self.device, dtype=self.dtype,
                                 world_size=1, trainable=False)
        max_seq_len = getattr(self.model, "max_seq_len", None)
        check_context_length(self.dataset, cfg.max_generated_tokens, max_seq_len)
        rules = token_rules(self.tokenizer, self.model, self.device)
        self.rollouts = RolloutRuntime(
            self.generator, cfg, rules=rules, ranks=D.ALONE, seed=self.seed,
            group_size=self.group_size, forward_batch_size=self.forward_batch_size,
            device=self.device, cache_dtype=self.dtype)
        collate = partial(collate_prompts, pad_id=int(getattr(self.tokenizer, "pad_id", 0)))
        self.shard_batches = {
            j: StepBatches(self.dataset, batch_size=self.batch_size,
                           world_size=self.world.roles.trainer_ranks, rank=j, seed=self.seed,
                           shuffle=cfg.shuffle, collate=collate)
            for j in self.shards}
        self.generator.setup(generation_context(
            cfg, checkpointer, self.dataset, max_seq_len=max_seq_len, device=self.device,
            dtype=self.dtype, world_size=1, rank=0, allowed_tokens=rules.allowed, lora=None))
        self.channel = PayloadChannel(self.world.payload_group)
        self.receiver = WeightReceiver(self.world.weight_control, self.world.weight_data)

    def train(self) -> None:
        """Generate every remaining step's batches for this rank's shards, each with the
        version it is due; stop when told to."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.world.weight_control)
        hello = box[0]
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]
        if hello["names"] != mine:
            raise RuntimeError("the rollout rank's model does not match the trainers' (parameter"
                               " names, shapes or dtypes differ)")
        k, version = int(self.cfg.max_staleness), 0
        with signals_only_logged(f"rollout rank {self.world.rank}"):
            for step in range(int(hello["start_step"]), int(self.cfg.num_steps)):
                start = time.perf_counter()
                while version < behavior_version(step, k):
                    received = self.receiver.receive(self.model)
                    if received is None:  # the trainers stopped early (preemption)
                        return self._finish(stopped=True)
                    version = received
                    self.generator.sync_weights(self.model)
                waited = time.perf_counter() - start
                for shard in self.shards:
                    batch = self.shard_batches[shard].batch(step)
                    for chunk, part in enumerate(split_batch(
                            batch, self.cfg.gradient_accumulation_steps)):
                        start = time.perf_counter()
                        traj = self.rollouts.rollout(self.model, part, step=step)
                        self.channel.send({
                            "step": step, "chunk": chunk, "version": version,
                            "trajectory": {f.name: getattr(traj, f.name)
                                           for f in fields(traj)},
                            "timing": {"generate_s": time.perf_counter() - start,
                                       "weight_wait_s": waited},
                        }, dst=shard)
                        waited = 0.0
            self._finish(stopped=False)

    def _finish(self, stopped: bool) -> None:
        """Wait for the stop message (after the last batch), tell each trainer shard this
        rank is done, and wait until everything sent was taken."""
        while not stopped:
            stopped = self.receiver.receive(self.model) is None
        for shard in self.shards:
            self.channel.send({"final": True}, dst=shard)
        self.channel.wait_sent()

    def cleanup(self) -> None:
        """Close the engine and the process group."""
        try:
            generator = getattr(self, "generator", None)
            if generator is not None:
                generator.close()
        finally:
            D.destroy()


def run_async_recipe(cfg: DictConfig) -> None:
    """Validate, build this rank's role (a :class:`~torchtune_grpo.training.recipe.GRPORecipe`
    with an :class:`AsyncRolloutSource`, or a :class:`RolloutWorker`), run it and clean up
    (also on failure)."""
    _validate_async(cfg)
    filled = with_defaults(cfg, {**RECIPE_KEYS, **ASYNC_KEYS})
    world = init_world(utils.get_device(filled.device), float(filled.distributed_timeout_s),
                        int(filled.rollout_ranks))
    trainer = world.roles.is_trainer(world.rank)
    # a rollout rank set up by Ctrl-C stops in one line, as the trainers do (their own)
    stop = None if trainer else StopSignals("the rollout rank", quiet=True).install()
    if trainer:
        role = GRPORecipe(cfg, source=AsyncRolloutSource(
            world, max_staleness=int(filled.max_staleness), num_steps=int(filled.num_steps)))
    else:
        role = RolloutWorker(cfg, world)
    try:
        with failures_reported_first(str(filled.output_dir)):
            role.setup()
            role.train()
    finally:
        role.cleanup()
        if stop is not None:
            stop.restore()
