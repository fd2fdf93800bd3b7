"""The peers the benchmarks compare against, each run by its own environment's Python as a file
(``.venv-trl/bin/python benchmarks/peers/trl_step.py --spec ... --out ...``): they import
nothing from this repository, so they stay standalone (no :mod:`benchmarks.harness`)."""
