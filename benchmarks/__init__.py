"""Speed and memory benchmarks of ``torchtune_grpo`` (see ``benchmarks/README.md``).

Each script is a module: ``python -m benchmarks.NAME`` from the repository root, or ``python
benchmarks/NAME.py``; the tests import them (``from benchmarks import step``). What they share
is in :mod:`benchmarks.harness`.
"""
