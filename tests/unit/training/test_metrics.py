"""Step timing and peak memory helpers of :mod:`torchtune_grpo.training.metrics`."""

from __future__ import annotations

import time

import torch

from torchtune_grpo.backends.memory import peak_rss_bytes
from torchtune_grpo.training.metrics import PhaseTimer, peak_memory_gb


def test_phase_timer_accumulates_each_phase_separately():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("generation"):
            time.sleep(0.02)
    with timer("update"):
        pass
    assert list(timer.seconds) == ["generation", "update"]
    assert timer.seconds["generation"] >= 0.04
    assert timer.seconds["update"] < timer.seconds["generation"]


def test_phase_timer_counts_a_phase_that_raises():
    timer = PhaseTimer()
    try:
        with timer("scoring"):
            time.sleep(0.01)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert timer.seconds["scoring"] >= 0.01


def test_peak_memory_gb_is_in_gigabytes_not_gibibytes():
    """``peak_memory_gb`` is the metric's name, so the value is bytes / 1e9 (it was GiB)."""
    ballast = torch.ones(256 * 1024 * 1024 // 4)  # 256 MiB resident
    assert ballast.sum() > 0
    gb = peak_memory_gb(torch.device("cpu"))
    assert abs(gb - peak_rss_bytes() / 1e9) < 0.05
    assert gb > peak_rss_bytes() / 1024**3 * 1.05  # GB > GiB for the same bytes, by 7.4%
