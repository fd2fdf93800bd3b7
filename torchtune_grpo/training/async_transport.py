"""The transport of the asynchronous recipe: who is who, rollouts trainer-ward, weights
rollout-ward (``docs/async.md``).

``torch.distributed`` only: rollouts travel as serialized tensors through point-to-point
``isend``/``recv`` on a gloo group (:class:`PayloadChannel`; they are small: token ids and
log-probs); weights travel from trainer rank 0 to the rollout ranks by ``broadcast`` on a group
of those ranks (:class:`WeightSender`, :class:`WeightReceiver`; NCCL on GPU), each a header
``[version, stop]`` and one flat buffer per dtype. :class:`VersionStore` keeps the trainer's
shards of the policy versions that batches still in flight were sampled by.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchtune_grpo import distributed as D
from torchtune_grpo.checkpoints.saving import resume_hint
from torchtune_grpo.errors import UserError

__all__ = [
    "AsyncWorld",
    "PayloadChannel",
    "Roles",
    "VersionStore",
    "WeightReceiver",
    "WeightSender",
    "behavior_version",
    "full_tensor",
    "init_world",
    "last_sent_version",
]


def behavior_version(step: int, max_staleness: int) -> int:
    """The policy version that samples the batch of ``step``: ``max(0, step - k)``."""
    return max(0, step - max_staleness)


def last_sent_version(num_steps: int, max_staleness: int) -> int:
    """The newest version a rollout rank ever needs (that of step ``num_steps - 1``); newer
    versions are never sent."""
    return behavior_version(num_steps - 1, max_staleness)


@dataclass(frozen=True)
class Roles:
    """Who does what in a world of ``world_size`` ranks with ``rollout_ranks`` generators.

    Trainer ranks come first (global rank 0 trains, logs and writes checkpoints); rollout
    rank ``T + r`` serves trainer shards ``r, r + R, r + 2R, ...``.
    """

    world_size: int
    rollout_ranks: int

    @property
    def trainer_ranks(self) -> int:
        """``T``: ranks that train."""
        return self.world_size - self.rollout_ranks

    def is_trainer(self, rank: int) -> bool:
        """Whether global ``rank`` trains."""
        return rank < self.trainer_ranks

    def rollout_rank_of(self, shard: int) -> int:
        """The global rank that generates trainer rank ``shard``'s batches."""
        return self.trainer_ranks + shard % self.rollout_ranks

    def shards_of(self, rank: int) -> list[int]:
        """The trainer ranks whose batches rollout rank ``rank`` (global) generates."""
        r = rank - self.trainer_ranks
        return list(range(r, self.trainer_ranks, self.rollout_ranks))

    @property
    def weight_ranks(self) -> list[int]:
        """Trainer rank 0 and every rollout rank: the group weights are broadcast over."""
        return [0, *range(self.trainer_ranks, self.world_size)]


# ---------------------------------------------------------------------------- transport
class PeerLost(ConnectionError):
    """The rank at the other end of a :class:`PayloadChannel` is gone (its process died or
    its connection closed) while this rank waited for its message.

    Args:
        rank: the global rank that stopped answering.
        why: the transport's own words, in one line.
    """

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} stopped answering ({why})")
        self.rank, self.why = rank, why


class RolloutRankLost(UserError):
    """A rollout rank of the asynchronous recipe died (killed, out of memory): not a bug of the
    trainers, which report it in one line with the checkpoint to resume from."""

    @classmethod
    def of(cls, lost: PeerLost, *, step: int, output_dir: str) -> RolloutRankLost:
        """The error for ``lost`` while waiting for the rollout of ``step``, naming the newest
        complete step folder of ``output_dir``."""
        return cls(f"rollout rank {lost.rank} died while the trainers waited for the rollout of "
                   f"step {step} ({lost.why}); {resume_hint(output_dir)}")


def recv_rollout(channel: PayloadChannel, src: int, step: int,
                 output_dir: str) -> dict[str, Any]:
    """The next message of rollout rank ``src`` for ``step``.

    Raises:
        RolloutRankLost: ``src`` died; one line naming it, ``step`` and the newest complete
            step folder of ``output_dir``.
    """
    try:
        return channel.recv(src)
    except PeerLost as exc:
        raise RolloutRankLost.of(exc, step=step, output_dir=output_dir) from None


class PayloadChannel:
    """Point-to-point messages of tensors and plain values between two ranks.

    A message is ``torch.save``-d into a ``uint8`` tensor and sent as its length then its
    bytes with ``dist.isend`` on a gloo group (CPU tensors on any backend). Sends do not
    block: the buffers stay referenced until :meth:`wait_sent`. Messages between the same two
    ranks arrive in the order they were sent.

    Args:
        group: a gloo process group holding both ends (global ranks address the peers).
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self.bytes_sent = 0

    def send(self, message: dict[str, Any], dst: int) -> None:
        """Queue ``message`` (tensors moved to CPU) for global rank ``dst``."""
        buffer = io.BytesIO()
        torch.save(_to_cpu(message), buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for tensor in (size, data):
            self._pending.append((dist.isend(tensor, dst=dst, group=self.group), tensor))
        self.bytes_sent += data.numel()
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, src: int) -> dict[str, Any]:
        """The next message from global rank ``src`` (blocks until it arrives).

        Raises:
            PeerLost: ``src`` died or closed its connection before the message was whole.
        """
        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.recv(size, src=src, group=self.group)
            data = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(data, src=src, group=self.group)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", ...
            if (why := D.peer_died(exc)) is None:
                raise
            raise PeerLost(src, why) from exc
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)

    def wait_sent(self) -> None:
        """Block until every queued message was received."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _local(param: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of ``param`` (the tensor itself when not sharded)."""
    return param.to_local() if hasattr(param, "to_local") else param


def full_tensor(param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """The whole of ``param`` (a collective over its mesh when sharded); with ``local``, the
    whole of the tensor sharded like ``param`` whose shard here is ``local``."""
    if not hasattr(param, "full_tensor"):
        return param.detach() if local is None else local
    if local is None:
        return param.detach().full_tensor()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride()).full_tensor()


class VersionStore:
    """The trainer's own shards of recent policy versions.

    Kept so that a stale batch's log-probs can be checked against the weights that sampled
    it (:meth:`swapped_in`) and so that a checkpoint can hold the versions its in-flight
    batches need (:meth:`gathered`). Memory: one shard-sized copy of the trainable weights
    per kept version.
    """

    def __init__(self) -> None:
        self.versions: dict[int, list[torch.Tensor]] = {}

    def keep(self, model: nn.Module, version: int) -> None:
        """Copy ``model``'s current shards as ``version``."""
        with torch.no_grad():
            self.versions[version] = [_local(p).detach().clone() for p in model.parameters()]

    def keep_full(self, model: nn.Module, version: int, state: dict[str, torch.Tensor]) -> None:
        """Keep ``version`` from a full state dict (as saved in a checkpoint): each rank
        slices its own shards out of it, no communication."""
        shards = []
        for name, p in model.named_parameters():
            full = state[name].to(p.device, p.dtype)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, p.device_mesh, p.placements,
                                         src_data_rank=None).to_local()
            shards.append(full.clone())
        self.versions[version] = shards

    def prune(self, oldest: int) -> None:
        """Forget every version below ``oldest``."""
        for version in [v for v in self.versions if v < oldest]:
            del self.versions[version]

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module, version: int) -> Iterator[None]:
        """``model`` holds ``version``'s weights inside the block, its own after (no grad;
        every trainer rank must enter together when sharded)."""
        params = list(model.parameters())
        with torch.no_grad():
            own = [_local(p).clone() for p in params]
            for p, saved in zip(params, self.versions[version]):
                _local(p).copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, mine in zip(params, own):
                    _local(p).copy_(mine)

    def gathered(self, model: nn.Module, version: int, keep: bool) -> dict[str, torch.Tensor]:
        """``version``'s full weights (a collective over the trainer ranks); CPU copies where
        ``keep`` (trainer rank 0), empty elsewhere."""
        out = {}
        for (name, p), local in zip(model.named_parameters(), self.versions[version]):
            full = full_tensor(p, local)
            if keep:
                out[name] = full.cpu().clone()
        return out


class WeightSender:
    """Trainer side of the weight flow: gathers the policy and broadcasts it to the rollout
    ranks from trainer rank 0 without waiting for them (``async_op``); the buffers stay
    referenced until the rollout ranks took them.

    Args:
        roles: the world's roles.
        control: gloo group of :attr:`Roles.weight_ranks` (headers).
        data: group of the same ranks (weights; NCCL on GPU).
        is_sender: True on trainer rank 0.
    """

    STOP = 1

    def __init__(self, roles: Roles, control: Any, data: Any, is_sender: bool) -> None:
        self.roles, self.control, self.data, self.is_sender = roles, control, data, is_sender
        self._pending: list[tuple[Any, Any]] = []
        self.bytes_sent = 0

    def send_full(self, version: int, full: list[torch.Tensor]) -> int:
        """Broadcast the full parameters ``full`` (model order) as ``version``; returns the bytes
        (0 on ranks other than the sender)."""
        if not self.is_sender:
            return 0
        header = torch.tensor([version, 0], dtype=torch.int64)
        self._queue(dist.broadcast(header, src=0, group=self.control, async_op=True), header)
        sent = 0
        for flat in _flatten_by_dtype(full):
            self._queue(dist.broadcast(flat, src=0, group=self.data, async_op=True), flat)
            sent += flat.numel() * flat.element_size()
        self.bytes_sent += sent
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        return sent

    def send(self, model: nn.Module, version: int) -> int:
        """Gather ``model``'s parameters (every trainer rank calls this) and broadcast them."""
        full = [full_tensor(p) for p in model.parameters()]
        return self.send_full(version, full)

    def stop(self) -> None:
        """Tell the rollout ranks to finish (trainer rank 0; others return at once)."""
        if self.is_sender:
            header = torch.tensor([-1, self.STOP], dtype=torch.int64)
            self._queue(dist.broadcast(header, src=0, group=self.control, async_op=True), header)

    def wait_sent(self) -> None:
        """Block until every broadcast was taken."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def _queue(self, work: Any, tensor: torch.Tensor) -> None:
        self._pending.append((work, tensor))


class WeightReceiver:
    """Rollout side of :class:`WeightSender`: takes the next broadcast into ``model``.

    Args:
        control, data: the sender's groups.
    """

    def __init__(self, control: Any, data: Any) -> None:
        self.control, self.data = control, data
        self.bytes_received = 0

    def receive(self, model: nn.Module) -> int | None:
        """Block for the next message; load its weights into ``model`` and return its version,
        or None when it is the stop message."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if int(header[1]) == WeightSender.STOP:
            return None
        params = list(model.parameters())
        for flat, members in _buffers_like(params):
            dist.broadcast(flat, src=0, group=self.data)
            self.bytes_received += flat.numel() * flat.element_size()
            with torch.no_grad():
                offset = 0
                for p in members:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        return int(header[0])


def _dtype_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _flatten_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat contiguous buffer per dtype, in :func:`_dtype_groups` order."""
    return [torch.cat([tensors[i].reshape(-1) for i in idx]) for idx in _dtype_groups(tensors)]


def _buffers_like(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Empty flat buffers matching :func:`_flatten_by_dtype` of ``params``, each with its
    parameters."""
    out = []
    for idx in _dtype_groups(params):
        members = [params[i] for i in idx]
        flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype,
                           device=members[0].device)
        out.append((flat, members))
    return out


# ---------------------------------------------------------------------------- the world
@dataclass
class AsyncWorld:
    roles: Roles
    rank: int
    trainer_group: Any
    payload_group: Any
    weight_control: Any
    weight_data: Any


def init_world(device: torch.device, timeout_s: float, rollout_ranks: int) -> AsyncWorld:
    """The default process group and the role groups (every rank creates every group, in the
    same order, as ``new_group`` requires)."""
    world_size, rank = D.init_distributed(device, timeout_s=timeout_s)
    roles = Roles(world_size, rollout_ranks)
    trainer_group = dist.new_group(list(range(roles.trainer_ranks)))
    payload_group = dist.new_group(list(range(world_size)), backend="gloo")
    weight_control = dist.new_group(roles.weight_ranks, backend="gloo")
    weight_data = dist.new_group(roles.weight_ranks)
    return AsyncWorld(roles, rank, trainer_group, payload_group, weight_control, weight_data)


class RolloutVersions:
    """The recipe-state entries of an asynchronous run: the policy versions that the batches
    after a saved step are sampled by, and ``max_staleness`` (a resume needs the same).

    Args:
        model: the policy (FSDP2-sharded over the trainer ranks).
        versions: the trainer's store of versions.
        max_staleness: ``k``.
        rollout_ranks: the run's rollout ranks (recorded).
        is_rank_zero: this is trainer rank 0 (it keeps the gathered versions).
    """

    def __init__(self, model: nn.Module, versions: VersionStore, *, max_staleness: int,
                 rollout_ranks: int, is_rank_zero: bool) -> None:
        self.model = model
        self.versions = versions
        self.max_staleness = max_staleness
        self.rollout_ranks = rollout_ranks
        self.is_rank_zero = is_rank_zero
        self.start_step = 0  # the step the run starts (or resumes) at
        self.resumed: dict[int, dict[str, torch.Tensor]] = {}  # version -> full state

    def state(self, step: int) -> dict[str, Any]:
        """Versions ``max(1, s - k) .. s - 1`` (version 0 is the base model, version ``s`` the
        saved one), gathered on rank 0 (a collective of the trainer ranks)."""
        k, s = self.max_staleness, step
        versions = {v: self.versions.gathered(self.model, v, keep=self.is_rank_zero)
                    for v in range(max(1, behavior_version(s, k)), s)}
        return {"max_staleness": k, "rollout_ranks": self.rollout_ranks,
                "rollout_versions": versions}

    def restore(self, state: dict[str, Any], resume_dir: Path) -> None:
        """Keep the saved versions for the start of the rollout ranks.

        Raises:
            ValueError: the folder was trained with another ``max_staleness``.
        """
        k = self.max_staleness
        if int(state.get("max_staleness", k)) != k:
            raise ValueError(f"resume_from_checkpoint: {resume_dir} was trained with "
                             f"max_staleness {state['max_staleness']}, the config says {k}")
        self.start_step = int(state["step"])
        self.resumed = dict(state.get("rollout_versions") or {})
