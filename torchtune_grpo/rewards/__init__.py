"""Scoring completions: answer extraction, reward components, math equivalence, and the reward
set that turns a config's list into per-completion rewards."""
