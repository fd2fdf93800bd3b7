"""Held-out evaluation (pass@k, greedy and sampled), paired comparison of two evaluations, and
per-prompt difficulty scoring of a training split."""
