"""keep_freed_memory: freed blocks are reused without page faults; the recipes apply it on CPU."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from torchtune_grpo.backends.allocator import GLIBC_MALLOC_ENV

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc malloc settings")

# Frees a 16 MiB tensor, then allocates a 4 and an 8 MiB one (as one layer's activations make
# room for the next one's), and prints whether the settings were applied and the minor page
# faults of those two allocations.
CHILD = """
import resource, sys
import torch
from torchtune_grpo.backends.allocator import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "on" else False
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = torch.ones(2**22); del first
before = faults()
later = [torch.ones(2**20), torch.ones(2**21)]
print(applied, faults() - before)
"""


def _child(setting: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if k not in GLIBC_MALLOC_ENV}
    out = subprocess.run([sys.executable, "-c", CHILD, setting], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    applied, faults = out.split()[-2:]
    return applied == "True", int(faults)


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    applied_off, faults_off = _child("off")
    applied_on, faults_on = _child("on")
    assert not applied_off and applied_on
    # glibc's default serves the 16 MiB block by mmap and gives it back when freed: the two
    # later blocks are fresh memory (3,072 faults of 4 KiB, or 6 of 2 MiB with transparent huge
    # pages); kept: they are carved from the freed block
    assert faults_off >= 6
    assert faults_on * 4 < faults_off, (faults_on, faults_off)


@glibc
def test_an_allocator_chosen_by_the_environment_is_left_alone():
    applied, faults = _child("on", MALLOC_TOP_PAD_="131072")  # glibc's default value
    assert not applied


def test_recipe_applies_it_on_cpu_unless_turned_off(monkeypatch, tmp_path):
    import torchtune_grpo.training.recipe as recipe_module
    from tests.recipes._helpers import quickstart_config
    from torchtune_grpo.backends import allocator

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    recipe_module.GRPORecipe(quickstart_config(tmp_path / "model", tmp_path / "out"))
    assert calls == [1]
    recipe_module.GRPORecipe(quickstart_config(tmp_path / "model", tmp_path / "out",
                                               "keep_freed_cpu_memory=false"))
    assert calls == [1]
