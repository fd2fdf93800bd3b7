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
    from torchtune_grpo.tiny import tiny_tokenizer

    return tiny_tokenizer(tmp_path / "tok")


@pytest.fixture
def tiny_model():
    from torchtune_grpo.tiny import tiny_llama

    torch.manual_seed(0)
    return tiny_llama()


def shared_data(relative: str) -> Path:
    """Path under ``../shared/data``; skips the test when it is absent."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path
