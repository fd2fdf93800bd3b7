"""Config fuzz (``tests/recipes/config_fuzz.py``), a sample in the slow tier: random mutations
of the shipped configs are accepted (and run one step where the model is here) or rejected in
one line naming the key, before any model is loaded. ``docs/reliability.md`` records a run of
500."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.recipes import config_fuzz
from tests.recipes._helpers import HERE, recipe_env

pytestmark = pytest.mark.slow


def test_mutations_are_named_by_the_error():
    cfg = {"loss": {"_component_": "x.Loss", "epsilon": 0.2}, "rewards": [{"weight": 1.0}],
           "num_steps": 3}
    seen = set()
    for seed in range(200):
        mutant = {"loss": dict(cfg["loss"]), "rewards": [dict(cfg["rewards"][0])],
                  "num_steps": 3}
        m = config_fuzz.mutate(mutant, random.Random(seed))
        seen.add(m["kind"])
        assert json.dumps(mutant, sort_keys=True) != json.dumps(cfg, sort_keys=True), m
        assert m["path"][0] in cfg
    assert seen == {"drop", "rename", "retype", "range"}
    assert config_fuzz.names({"kind": "drop", "path": ["loss", "_component_"]}) >= {"loss"}
    assert "weight" in config_fuzz.names({"kind": "range", "path": ["rewards", 0, "weight"]})
    report = {"stage": "validate", "error_type": "ConfigError",
              "error": "config key 'num_steps' must be > 0"}
    assert config_fuzz.classify(report, {"kind": "range", "path": ["num_steps"]}) == "rejected"
    assert config_fuzz.classify({**report, "error_type": "TypeError"},
                                {"kind": "range", "path": ["num_steps"]}) == "unclear"
    assert config_fuzz.classify(report, {"kind": "range", "path": ["group_size"]}) == "unclear"
    assert config_fuzz.classify({**report, "model_loaded": True},
                                {"kind": "range", "path": ["num_steps"]}) == "late"


def test_a_sample_of_mutants_is_accepted_or_named(base_model, tmp_path):
    # in its own process: the fuzz forks a child per mutant, which is only safe from a process
    # that has not started OpenMP threads (this one has run other tests)
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(HERE / "config_fuzz.py"), "--mutations", "24",
                           "--seed", "1", "--base", str(base_model), "--out", str(out),
                           "--runnable-share", "0.6"],
                          cwd=tmp_path, env=recipe_env(1), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(out.read_text())
    tally = config_fuzz.tally(records)
    failures = [r for r in records if r["outcome"] in config_fuzz.FAILURES]
    assert len(records) == 24 and not failures, (tally, failures)
    # not degenerate: mutants were rejected, and some ran their step
    assert tally.get("rejected", 0) >= 5 and tally.get("ran", 0) >= 3, tally
