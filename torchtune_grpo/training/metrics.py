"""Step metrics: the metrics of a step over all ranks, timing its phases, peak memory, the
progress display, and reading back what a run logged (for tests, plots and ablations).

The recipes log through torchtune's ``metric_logger``; the shipped configs use
:class:`torchtune.training.metric_logging.DiskLogger`, which writes one line per step,
``Step N | name:value name:value ...``, into ``output_dir/logs/log_<time>.txt``.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torchtune import utils

from torchtune_grpo import distributed as D
from torchtune_grpo.algorithm.advantages import AdvantageOutput
from torchtune_grpo.algorithm.trajectory import Trajectory
from torchtune_grpo.progress import Progress
from torchtune_grpo.rewards.reward_set import RewardOutput
from torchtune_grpo.rollout.tool_trajectory import ToolStats

log = utils.get_logger("INFO")


def read_disk_log(path: str | Path) -> list[dict[str, float]]:
    """Metrics of every logged step, in order, each with its ``step``.

    Args:
        path: a DiskLogger file, or a folder holding them: all are read, oldest first, and a
            step logged again (a resumed run repeats the steps after its checkpoint) keeps
            its newest values.

    Raises:
        FileNotFoundError: no log file at ``path``.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("log_*.txt"), key=lambda p: (p.stat().st_mtime, p.name))
        if not files:
            raise FileNotFoundError(f"no DiskLogger file (log_*.txt) in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"metric log {path} not found")
    rows: dict[int, dict[str, float]] = {}
    for file in files:
        _read_into(file, rows)
    return [rows[k] for k in sorted(rows)]


def _read_into(path: Path, rows: dict[int, dict[str, float]]) -> None:
    seen: set[int] = set()
    for line in path.read_text().splitlines():
        if not line.startswith("Step ") or "|" not in line:
            continue
        head, _, body = line.partition("|")
        step = int(head.split()[1])
        if step not in seen:  # first line of this step in this file: replaces older values
            rows[step] = {"step": float(step)}
            seen.add(step)
        row = rows[step]
        for item in body.split():
            name, _, value = item.rpartition(":")
            try:
                row[name] = float(value)
            except ValueError:
                continue


class PhaseTimer:
    """Seconds spent in each named phase of a step: ``with timer("update"): ...``.

    A phase entered several times (one per gradient-accumulation chunk) accumulates;
    :attr:`seconds` maps phase names to totals, in first-entry order.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Time the ``with`` body and add it to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def peak_memory_gb(device: Any) -> float:
    """Peak memory of this process since the start, in GB (10**9 bytes).

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only). CPU: the process's peak resident
    set size (:func:`~torchtune_grpo.backends.memory.peak_rss_bytes`; Python, libraries and data
    included), the only peak the OS keeps.
    """
    import torch

    if getattr(device, "type", device) == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    from torchtune_grpo.backends.memory import peak_rss_bytes

    return peak_rss_bytes() / 1e9


def _global_mean(values: torch.Tensor, ranks: D.Ranks, device: torch.device) -> float:
    t = torch.tensor([values.float().sum().item(), values.numel()], dtype=torch.float64,
                     device=device)
    ranks.all_reduce(t, "sum")
    return float(t[0] / t[1])


def step_metrics(traj: Trajectory, rewards: RewardOutput, adv: AdvantageOutput,
                 loss_metrics: dict[str, float], seconds: dict[str, float], *, ranks: D.Ranks,
                 device: torch.device, group_size: int, lr: float, skipped_rows: float,
                 tool_stats: ToolStats | None, peak_memory: bool) -> dict[str, float]:
    """The metrics of one step, averaged (or summed, for counts) over ``ranks``
    (``docs/metrics.md``); a collective: every rank calls it.

    Args:
        traj: the step's rollout on this rank.
        rewards: its rewards.
        adv: its advantages.
        loss_metrics: what the update returned.
        seconds: seconds per phase of the step.
        ranks: the ranks that train together.
        device: where the reductions run.
        group_size: completions per prompt.
        lr: the learning rate after the step.
        skipped_rows: dataset rows skipped so far (``data/skipped_rows``).
        tool_stats: the step's tool counts on this rank, or None without tools.
        peak_memory: add ``peak_memory_gb``.
    """
    def mean(values: torch.Tensor) -> float:
        return _global_mean(values, ranks, device)

    total = rewards.total.float()
    reward_mean = mean(total)
    mean_sq = mean(total * total)
    metrics = {
        "reward/mean": reward_mean,
        "reward/std": math.sqrt(max(mean_sq - reward_mean * reward_mean, 0.0)),
        "success_rate": mean(rewards.success.float()),
        "response_length/mean": mean(traj.response_lengths.float()),
        "truncated_fraction": mean((~traj.stopped).float()),
        "zero_std_group_fraction": mean(adv.zero_std_groups.float()),
        # groups whose completions were all right: tied, but solved (run health)
        "solved_group_fraction": mean(rewards.success.reshape(-1, group_size).all(1).float()),
    }
    for name, values in rewards.components.items():
        metrics[f"reward/{name}"] = mean(values.float())
    for name, count in rewards.errors.items():
        errors = ranks.all_reduce(torch.tensor([float(count)], device=device), "sum")
        metrics[f"reward/{name}/errors"] = float(errors)
    for name, count in sorted(rewards.counts.items()):  # a component's own counters
        total_count = ranks.all_reduce(torch.tensor([float(count)], device=device), "sum")
        metrics[f"reward/{name}"] = float(total_count)
    metrics["data/skipped_rows"] = skipped_rows
    metrics.update(loss_metrics)
    metrics["lr"] = lr
    generated = torch.tensor([float(traj.response_mask.sum())], device=device)
    ranks.all_reduce(generated, "sum")
    metrics["tokens_per_second/generation"] = float(generated) / max(seconds["generation"], 1e-9)
    if tool_stats is not None:  # every rollout of the step, summed over ranks
        sums = ranks.all_reduce(tool_stats.as_tensor().to(device), "sum")
        metrics.update(ToolStats.metrics(sums.cpu()))
    metrics.update({f"time/{phase}": value for phase, value in seconds.items()})
    if peak_memory:
        metrics["peak_memory_gb"] = peak_memory_gb(device)
    return metrics


class StepProgress:
    """The training loop's progress on rank 0: a redrawn bar on a terminal, one log line per
    step when the output goes to a file, nothing when not ``show``; a context manager.

    Reward components that failed and scored 0 (``on_error: zero``) are counted on the step's
    line and, when ``warn``, in a warning whatever ``show`` says.

    Args:
        num_steps: the run's last step.
        step: the steps finished before the loop starts.
        show: display anything at all.
        warn: warn of the step's reward-component failures (rank 0).
        work: the run's :class:`~torchtune_grpo.progress.Progress`, told of each step's line so
            that its own lines come only while a step runs long.
    """

    def __init__(self, num_steps: int, step: int, *, show: bool, warn: bool = False,
                 work: Progress | None = None) -> None:
        from tqdm import tqdm

        self.num_steps = num_steps
        self.warn = warn
        self.work = work
        self.lines = show and not sys.stderr.isatty()
        self.bar = None if self.lines else tqdm(total=num_steps, initial=step, disable=not show)

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Show that ``step`` finished with ``metrics``."""
        if self.work is not None:
            self.work.mark()
        failed = reward_errors(metrics)
        note = f", {sum(failed.values())} reward errors" if failed else ""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_description(
                f"step {step} reward {metrics['reward/mean']:.3f} "
                f"success {metrics['success_rate']:.2f}{note}")
        elif self.lines:  # output to a file: one line per step, not a redrawn bar
            log.info(f"step {step}/{self.num_steps}: reward "
                     f"{metrics['reward/mean']:.3f}, success {metrics['success_rate']:.2f}, "
                     f"{metrics.get('time/step', 0.0):.1f} s{note}")
        if failed and self.warn:
            log.warning(f"step {step}: reward components failed and scored 0 (on_error: zero): "
                        + ", ".join(f"{name} on {n} samples" for name, n in failed.items()))


def reward_errors(metrics: dict[str, float]) -> dict[str, int]:
    """``component -> samples it failed on`` in a step's ``metrics`` (``reward/<name>/errors``
    above 0; every rank's summed)."""
    return {key[len("reward/"):-len("/errors")]: int(value) for key, value in metrics.items()
            if key.startswith("reward/") and key.endswith("/errors") and value > 0}
