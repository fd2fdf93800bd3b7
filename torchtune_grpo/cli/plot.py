"""Plot a run's metrics: ``python -m torchtune_grpo.cli.plot OUTPUT_DIR [--out FILE.png]``.

One panel per metric (reward, success rate, ``eval/pass@1``, response length from 0, KL,
entropy) against the step, from ``OUTPUT_DIR/logs``, with the steps where a run-health
condition held shaded; default output ``OUTPUT_DIR/metrics.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchtune_grpo.training.metrics import read_disk_log

#: (metric, panel title) in panel order.
PANELS = [
    ("reward/mean", "reward (train, mean)"),
    ("success_rate", "success rate (train)"),
    ("eval/pass@1", "held-out pass@1"),
    ("response_length/mean", "response length (tokens)"),
    ("kl", "KL to reference"),
    ("entropy", "entropy (nats/token)"),
]
#: Shading colour of each run-health condition.
HEALTH_COLORS = {"no_signal": "tab:gray", "length_collapse": "tab:orange",
                 "reward_hacking": "tab:red"}


def health_spans(rows: list[dict[str, float]]) -> dict[str, list[tuple[float, float]]]:
    """Steps where each run-health condition held, as ``(first, last)`` step spans.

    Args:
        rows: the run's logged rows (:func:`~torchtune_grpo.training.metrics.read_disk_log`).

    Returns:
        ``{condition: [(first_step, last_step), ...]}`` for the conditions that held.
    """
    spans: dict[str, list[tuple[float, float]]] = {}
    for name in HEALTH_COLORS:
        key = f"health/{name}"
        steps = [r["step"] for r in rows if r.get(key) == 1.0]
        runs: list[list[float]] = []
        for step in steps:
            if runs and step - runs[-1][1] <= 1:
                runs[-1][1] = step
            else:
                runs.append([step, step])
        if runs:
            spans[name] = [(a, b) for a, b in runs]
    return spans


def plot_run(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the metrics of the run in ``output_dir`` into a PNG and return its path.

    Raises:
        FileNotFoundError: no metric log in ``output_dir/logs``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    rows = read_disk_log(output_dir / "logs")
    out = Path(out) if out is not None else output_dir / "metrics.png"
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    spans = health_spans(rows)
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, runs in spans.items():
            for i, (a, b) in enumerate(runs):
                ax.axvspan(a - 0.5, b + 0.5, color=HEALTH_COLORS[name], alpha=0.15, lw=0,
                           label=f"health: {name}" if i == 0 else None)
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 15 else None, markersize=4)
            if key == "response_length/mean":
                ax.set_ylim(bottom=0, top=max(ys) * 1.1 if max(ys) > 0 else 1)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if spans:
        axes.flat[0].legend(loc="best", fontsize=8)
    fig.suptitle(f"GRPO run: {output_dir}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m torchtune_grpo.cli.plot", description=__doc__)
    parser.add_argument("output_dir")
    parser.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/metrics.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.output_dir, args.out)}")


if __name__ == "__main__":
    main()
