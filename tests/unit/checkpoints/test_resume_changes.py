"""What a resume may change: the config diff, the refusal of a changed run, and the optimizer
and scheduler settings put back over a restored state."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

from torchtune_grpo.checkpoints.resume_changes import (
    apply_optimizer_settings,
    check_changes,
    config_changes,
    describe_changes,
)
from torchtune_grpo.errors import CheckpointError, UserError

SAVED = {"seed": 0, "group_size": 4, "batch_size": 2, "output_dir": "/runs/a",
         "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
         "dataset": {"_component_": "x.gsm8k", "split": "train"},
         "checkpointer": {"checkpoint_dir": "/m", "output_dir": "/runs/a"},
         "rewards": [{"_component_": "r.A", "weight": 1.0}, {"_component_": "r.B", "weight": 1}],
         "num_steps": 10}


def _new(**changes):
    cfg = copy.deepcopy(SAVED)
    for key, value in changes.items():
        node = cfg
        *path, last = key.split("__")
        for p in path:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value
    return cfg


def test_an_unchanged_config_has_no_changes():
    assert config_changes(SAVED, _new(), saved_global_batch=2, new_global_batch=2) == []
    # 1 and 1.0 are one value; where the run lives is not a change
    assert config_changes(SAVED, _new(rewards__1__weight=1.0, output_dir="/elsewhere",
                                      checkpointer__output_dir="/elsewhere")) == []


def test_changes_are_listed_by_dotted_key_and_classified():
    changes = config_changes(SAVED, _new(optimizer__lr=1e-7, rewards__0__weight=0.5,
                                         group_size=8, dataset__split="train[:10]"))
    by_key = {c.key: c for c in changes}
    assert set(by_key) == {"optimizer.lr", "rewards[0].weight", "group_size", "dataset.split"}
    assert not by_key["optimizer.lr"].fixed and not by_key["rewards[0].weight"].fixed
    assert by_key["group_size"].fixed and by_key["dataset.split"].fixed
    assert by_key["optimizer.lr"].line() == "optimizer.lr: 0.001 -> 1e-07 (takes effect)"
    assert "changes the completions per prompt" in by_key["group_size"].line()
    block = describe_changes(changes, Path("/runs/a/step_3"))
    assert block.splitlines()[0] == "resuming from /runs/a/step_3 with 4 changed config key(s):"
    assert len(block.splitlines()) == 5


def test_a_key_added_or_removed_is_a_change():
    new = _new()
    new["temperature"] = 0.7
    del new["num_steps"]
    keys = {c.key: (c.saved, c.new) for c in config_changes(SAVED, new)}
    assert keys == {"temperature": ("<unset>", 0.7), "num_steps": (10, "<unset>")}


def test_the_global_batch_is_compared_not_the_per_rank_key():
    # 2 ranks x 2 prompts resumed on 1 rank x 4: the same global batch, nothing changed
    assert config_changes(SAVED, _new(batch_size=4), saved_global_batch=4,
                          new_global_batch=4) == []
    [change] = config_changes(SAVED, _new(batch_size=4), saved_global_batch=4,
                              new_global_batch=8)
    assert (change.key, change.saved, change.new, change.fixed) == ("global batch", 4, 8, True)


def test_a_fixed_change_stops_in_one_line_unless_allowed():
    changes = config_changes(SAVED, _new(optimizer__lr=1e-4, seed=1, group_size=8))
    with pytest.raises(CheckpointError) as info:
        check_changes(changes, Path("/runs/a/step_3"), allow=False)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError)
    assert message.startswith("resume_from_checkpoint: seed was 0 in /runs/a/step_3, the "
                              "config says 1 (and group_size)")
    assert "resume_allow_changes=true" in message
    check_changes(changes, Path("/runs/a/step_3"), allow=True)
    check_changes([c for c in changes if not c.fixed], Path("/x"), allow=False)


def test_records_are_plain_values():
    [change] = config_changes(SAVED, _new(rewards__0___component_="r.C"))
    assert change.record(3) == {"step": 3, "key": "rewards[0]._component_", "saved": "r.A",
                                "new": "r.C", "fixed": False}


def _trained(lr: float, num_training_steps: int, steps: int):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=(0.9, 0.99))
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2,
                                            num_training_steps=num_training_steps)
    for _ in range(steps):
        sum((p ** 2).sum() for p in params).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return params, opt, sched


def _resumed(saved_opt, saved_sched, *, lr, num_training_steps, betas=(0.9, 0.99)):
    params = [torch.nn.Parameter(p.detach().clone()) for g in saved_opt.param_groups
              for p in g["params"]]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01, betas=betas)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2,
                                            num_training_steps=num_training_steps)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.load_state_dict(saved_opt.state_dict())
    sched.load_state_dict(saved_sched.state_dict())
    apply_optimizer_settings(opt, fresh, sched)
    return opt, sched


def test_an_unchanged_config_restores_every_setting_bitwise():
    _, opt, sched = _trained(1e-3, 10, 4)
    resumed, rsched = _resumed(opt, sched, lr=1e-3, num_training_steps=10)
    assert resumed.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert rsched.state_dict() == sched.state_dict()


def test_a_lowered_lr_and_a_longer_schedule_take_effect_over_the_restored_state():
    _, opt, sched = _trained(1e-3, 10, 4)
    resumed, rsched = _resumed(opt, sched, lr=1e-5, num_training_steps=40, betas=(0.8, 0.9))
    fresh_lambda = get_cosine_schedule_with_warmup(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), num_warmup_steps=2,
        num_training_steps=40).lr_lambdas[0]
    assert rsched.last_epoch == 4  # the schedule position is kept
    assert rsched.base_lrs == [1e-5]
    group = resumed.param_groups[0]
    assert group["lr"] == 1e-5 * fresh_lambda(4) != opt.param_groups[0]["lr"]
    assert group["betas"] == (0.8, 0.9) and rsched.get_last_lr() == [group["lr"]]
    # the moments are the saved ones
    for a, b in zip(opt.state.values(), resumed.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])


def test_without_a_scheduler_the_configured_lr_is_used():
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    params[0].sum().backward()
    opt.step()
    new = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=2e-4)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups]
    new.load_state_dict(opt.state_dict())
    assert new.param_groups[0]["lr"] == 1e-3  # what load_state_dict alone does
    apply_optimizer_settings(new, fresh, None)
    assert new.param_groups[0]["lr"] == 2e-4


def test_how_the_checkpointer_saves_may_change_but_not_the_base_model_it_reads():
    changes = config_changes(SAVED, _new(checkpointer___component_="my.Checkpointer"))
    assert [(c.key, c.fixed) for c in changes] == [("checkpointer._component_", False)]
    changes = config_changes(SAVED, _new(checkpointer__checkpoint_dir="/other"))
    assert [(c.key, c.fixed) for c in changes] == [("checkpointer.checkpoint_dir", True)]
