"""The recipes seed as torchtune does, without its "Local seed is seed + rank" line."""

from __future__ import annotations

import logging

import torch

from torchtune_grpo import distributed as D


def test_set_seed_seeds_without_the_local_seed_line(caplog):
    logger = logging.getLogger("torchtune.utils._logging")
    logger.setLevel(logging.DEBUG)  # as torchtune's modules leave it
    with caplog.at_level(logging.DEBUG, logger="torchtune.utils._logging"):
        assert D.set_seed(7) == 7
    assert torch.initial_seed() == 7
    assert not [r for r in caplog.records if "Local seed" in r.getMessage()]
    assert logger.level == logging.DEBUG  # put back
