"""Plot a run's metrics: ``python -m torchtune_grpo.plot OUTPUT_DIR [--out FILE.png]``.

Reads the DiskLogger files of ``OUTPUT_DIR/logs`` and draws reward, success rate, held-out
``eval/pass@1``, response length, KL and entropy against the step, one panel each, into a PNG
(default ``OUTPUT_DIR/metrics.png``). Panels whose metric was never logged say so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torchtune_grpo.metrics import read_disk_log

#: (metric, panel title) in panel order.
PANELS = [
    ("reward/mean", "reward (train, mean)"),
    ("success_rate", "success rate (train)"),
    ("eval/pass@1", "held-out pass@1"),
    ("response_length/mean", "response length (tokens)"),
    ("kl", "KL to reference"),
    ("entropy", "entropy (nats/token)"),
]


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
    for ax, (key, title) in zip(axes.flat, PANELS):
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(xs) < 15 else None, markersize=4)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"GRPO run: {output_dir}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m torchtune_grpo.plot", description=__doc__)
    parser.add_argument("output_dir")
    parser.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/metrics.png)")
    args = parser.parse_args(argv)
    print(f"wrote {plot_run(args.output_dir, args.out)}")


if __name__ == "__main__":
    main()
