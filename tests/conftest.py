"""Shared fixtures: tiny models, tokenizers and checkpoints built locally, never downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# Two cores on CI: keep torch from oversubscribing them when tests start subprocesses.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def tokenizer(tmp_path):
    from torchtune_grpo.quickstart.tiny import tiny_tokenizer

    return tiny_tokenizer(tmp_path / "tok")


@pytest.fixture
def tiny_model():
    from torchtune_grpo.quickstart.tiny import tiny_llama

    torch.manual_seed(0)
    return tiny_llama()


def shared_data(relative: str) -> Path:
    """Path under ``../shared/data``; skips the test when it is absent."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def check_instantiates_offline(cfg, min_params: float) -> None:
    """Build everything a training config needs that no download provides, and check it.

    The model on the meta device (at least ``min_params`` parameters), the loss, the rewards,
    the optimizer (on a dummy parameter) and the LR scheduler; the checkpointer reads
    ``model_dir``.
    """
    from torchtune import config as tt_config

    from torchtune_grpo.rewards.build import build_reward_set

    with torch.device("meta"):
        model = tt_config.instantiate(cfg.model)
    assert sum(p.numel() for p in model.parameters()) > min_params
    loss = tt_config.instantiate(cfg.loss)
    assert loss.needs_reference == (cfg.loss.kl_coeff != 0)
    rewards = build_reward_set(cfg.rewards)
    assert rewards.success_name in rewards.names
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = tt_config.instantiate(cfg.optimizer, params)
    if cfg.get("lr_scheduler") is not None:  # null: a constant learning rate
        scheduler = tt_config.instantiate(cfg.lr_scheduler, optimizer=optimizer,
                                          num_training_steps=cfg.num_steps)
        assert scheduler is not None
    assert cfg.checkpointer.checkpoint_dir == cfg.model_dir


def config_json_alone(cfg, root: Path) -> Path:
    """A folder holding only the released ``config.json`` of the model ``cfg`` names (its
    ``model_dir``, else ``checkpoint_dir``), as before a download: ``root/<folder name>``.

    The shape comes from :data:`torchtune_grpo.cli.known_shapes.KNOWN_SHAPES`; load the config
    again with ``model_dir=<returned folder>`` to build its model offline.
    """
    import json

    from torchtune_grpo.cli.known_shapes import known_shape

    folder = str(cfg.get("model_dir") or cfg.get("checkpoint_dir"))
    found = known_shape(folder)
    assert found is not None, f"no known shape for {folder}"
    out = root / Path(folder).name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(found[1]))
    return out
