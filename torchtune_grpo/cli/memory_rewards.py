"""Memory of the learned rewards of a config (``RewardModelScore``, ``GenerativeJudge``): their
frozen models, sized from their folders on the meta device, for
:func:`torchtune_grpo.cli.memory_estimate.estimate_memory` (``docs/memory.md``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

#: Bytes per element of an entry's ``dtype``.
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


#: ``rewards`` components whose frozen model :func:`learned_reward_memory` counts, by class
#: name: ``"classifier"`` (a scoring forward) or ``"judge"`` (greedy generation).
LEARNED_REWARDS = {"RewardModelScore": "classifier", "GenerativeJudge": "judge"}


@dataclass(frozen=True)
class LearnedRewardMemory:
    """Memory of one learned-reward entry of ``rewards`` (bytes).

    Attributes:
        name: the entry's ``name`` (else the component's own, as the reward set names it).
        device: where its model lives (the entry's ``device``, default ``cpu``).
        params: parameters of its torchtune model.
        weights: ``params`` in the entry's ``dtype``.
        scoring: the peak of scoring one batch: the forward's temporaries over ``batch_size``
            sequences of ``max_seq_len`` tokens, and for a judge its KV cache and sampling
            buffers (freed after the call).
    """

    name: str
    device: str
    params: int
    weights: int
    scoring: int


def learned_reward_memory(cfg: DictConfig) -> tuple[list[LearnedRewardMemory], list[str]]:
    """The frozen models of the config's learned rewards (``RewardModelScore``,
    ``GenerativeJudge``), sized from their folders' ``config.json`` on the meta device.

    Args:
        cfg: a training config.

    Returns:
        ``(entries, not_counted)``: one :class:`LearnedRewardMemory` per learned entry whose
        folder could be read, and a line per entry that could not (its name, folder and why).
    """
    from torchtune_grpo.models.builders import hf_architecture, hf_model, read_hf_config
    from torchtune_grpo.models.classifier import build_classifier, hf_classifier_architecture

    found: list[LearnedRewardMemory] = []
    missing: list[str] = []
    for i, entry in enumerate(cfg.get("rewards") or []):
        component = str(entry.get("_component_", "")).rsplit(".", 1)[-1]
        kind = LEARNED_REWARDS.get(component)
        if kind is None:
            continue
        name = str(entry.get("name") or _component_name(component))
        model_dir = str(entry.get("model_dir", ""))
        b = DTYPE_BYTES.get(str(entry.get("dtype", "fp32")), 4)
        batch = int(entry.get("batch_size", 8) or 8)
        seq = int(entry.get("max_seq_len", 4096 if kind == "classifier" else 2048))
        try:
            hf = read_hf_config(model_dir)
            where = f"{model_dir}/config.json"
            if kind == "classifier":
                arch = hf_classifier_architecture(hf, where=where, max_seq_len=seq)
                with torch.device("meta"):
                    model = build_classifier(arch)
            else:
                arch = hf_architecture(hf, where=where, max_seq_len=seq)
                with torch.device("meta"):
                    model = hf_model(model_dir, max_seq_len=seq)
        except (OSError, ValueError) as exc:
            missing.append(f"rewards[{i}] ({name}): {model_dir or 'no model_dir'}: {exc}")
            continue
        params = sum(p.numel() for p in dict(model.named_parameters()).values())
        kw = arch.builder_kwargs
        d, f = int(kw["embed_dim"]), int(kw["intermediate_dim"])
        heads, kv_heads = int(kw["num_heads"]), int(kw["num_kv_heads"])
        head_dim = int(kw.get("head_dim") or d // heads)
        # a no-grad forward keeps about one layer's working set per token: the residual
        # stream, q/k/v/attention output and the MLP's hidden tensors
        forward = batch * seq * (4 * d + 3 * f) * b
        scoring = forward
        if kind == "judge":
            layers = int(kw["num_layers"])
            kv_cache = batch * layers * 2 * kv_heads * head_dim * seq * b
            sampling = batch * int(kw["vocab_size"]) * 4 * 4
            scoring = kv_cache + forward + sampling
        found.append(LearnedRewardMemory(
            name=name, device=str(entry.get("device", "cpu")), params=int(params),
            weights=int(params * b), scoring=int(scoring)))
    return found, missing


def _component_name(component: str) -> str:
    """The metric name a learned-reward class gives itself (its ``name`` attribute)."""
    from torchtune_grpo.rewards import learned

    return str(getattr(learned, component).name)


def same_device(a: str, policy: str) -> bool:
    """Whether ``a`` (a reward entry's device) is the policy's device ``policy``: the same
    type, and no other index."""
    try:
        da, dp = torch.device(a), torch.device(policy)
    except (RuntimeError, TypeError):
        return False
    if da.type != dp.type:
        return False
    return da.type == "cpu" or da.index is None or da.index == (dp.index or 0)


def by_device(learned: list[LearnedRewardMemory], policy_device: str
              ) -> tuple[list[LearnedRewardMemory], dict[str, int]]:
    """Split learned rewards into those on the policy's device and the bytes (weights plus
    one scoring batch) of the others, by device."""
    local = [r for r in learned if same_device(r.device, policy_device)]
    others: dict[str, int] = {}
    for r in learned:
        if r not in local:
            others[r.device] = others.get(r.device, 0) + r.weights + r.scoring
    return local, others
