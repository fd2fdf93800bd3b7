"""What a resume changed: the new config against the one saved in the step folder.

A resumed run lists every key whose value differs from the step's saved config, in one block.
Keys that tune the run (learning rate and schedule, loss, sampling, evaluation, length, saving,
logging) take effect, over the restored optimizer and scheduler state too
(:func:`apply_optimizer_settings`). Keys that change what the run *is* (:data:`FIXED`: the
data order, the group, the model, the seed) stop the resume in one line unless
``resume_allow_changes: true``; the changes are then recorded in the step's recipe state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchtune_grpo.errors import CheckpointError

#: Keys (dotted prefixes) whose change makes a resumed run another run, and what they change.
FIXED: dict[str, str] = {
    "seed": "the prompts and samples of every later step",
    "global batch": "the prompts of every later step",
    "group_size": "the completions per prompt and so the advantages",
    "dataset": "the prompts of every later step",
    "shuffle": "the prompt order",
    "model": "the network the weights belong to",
    "model_dir": "the base model",
    "checkpointer.checkpoint_dir": "the base model",
    "checkpointer.checkpoint_files": "the base model",
    "checkpointer.model_type": "the base model",
    "tokenizer": "the token ids the weights were trained on",
}

#: Keys that name where the run is, not what it does: never listed.
IGNORED = ("resume_from_checkpoint", "resume_allow_changes", "overwrite_output_dir",
           "output_dir", "checkpointer.output_dir", "batch_size", "global_batch_size")

_MISSING = "<unset>"


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between a step's saved config and the resuming one.

    Args:
        key: the dotted key (``optimizer.lr``, ``rewards[0].weight``, ``global batch``).
        saved: its value in the step folder (``"<unset>"`` when absent there).
        new: its value now (``"<unset>"`` when absent now).
        fixed: the key changes what the run means (:data:`FIXED`).
    """

    key: str
    saved: Any
    new: Any
    fixed: bool

    def line(self) -> str:
        """``key: saved -> new`` and what the change does."""
        what = (f"changes {_fixed_reason(self.key)}" if self.fixed else "takes effect")
        return f"{self.key}: {_show(self.saved)} -> {_show(self.new)} ({what})"

    def record(self, step: int) -> dict[str, Any]:
        """The change as plain values, as kept in ``recipe_state.pt`` (``config_changes``)."""
        return {"step": step, "key": self.key, "saved": _plain(self.saved),
                "new": _plain(self.new), "fixed": self.fixed}


def _fixed_reason(key: str) -> str:
    for prefix, reason in FIXED.items():
        if _under(key, prefix):
            return reason
    return ""


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith((prefix + ".", prefix + "["))


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) and value != _MISSING else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _plain(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """``{dotted key: leaf}`` of a nested config (lists index as ``key[i]``)."""
    if isinstance(node, Mapping) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(node, (list, tuple)) and node:
        for i, v in enumerate(node):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = node
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values (``1 == 1.0``; ``True`` is not ``1``; NaN equals NaN)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any], *,
                   saved_global_batch: int | None = None,
                   new_global_batch: int | None = None) -> list[ConfigChange]:
    """Every key whose value differs between ``saved`` and ``new``, in ``new``'s key order
    (then keys only ``saved`` has).

    ``batch_size``/``global_batch_size`` are compared as the global batch (prompts per step over
    all ranks), so resuming on other ranks with the same global batch changes nothing.

    Paths under the saved ``output_dir`` are compared as if under the new one (a resume from a
    step folder into another run folder moves the logs with it).

    Args:
        saved: the resolved config stored in the step folder.
        new: the resolved config of the resuming run.
        saved_global_batch: prompts per step of the saved run (``recipe_state.pt``).
        new_global_batch: prompts per step of the resuming run.

    Returns:
        The changes; ``fixed`` marks those under :data:`FIXED`.
    """
    old_flat = _flatten(dict(saved), "", {})
    new_flat = _flatten(dict(new), "", {})
    # paths under the output folder (logs, the checkpointer's) follow a resume into another one
    old_out, new_out = str(saved.get("output_dir", "")), str(new.get("output_dir", ""))
    if old_out and new_out and old_out != new_out:
        old_flat = {k: v.replace(old_out, new_out) if isinstance(v, str) else v
                    for k, v in old_flat.items()}
    keys = list(new_flat) + [k for k in old_flat if k not in new_flat]
    changes = []
    if (saved_global_batch is not None and new_global_batch is not None
            and saved_global_batch != new_global_batch):
        changes.append(ConfigChange("global batch", saved_global_batch, new_global_batch, True))
    for k in keys:
        if any(_under(k, ignored) for ignored in IGNORED):
            continue
        a, b = old_flat.get(k, _MISSING), new_flat.get(k, _MISSING)
        if not _same(a, b):
            changes.append(ConfigChange(k, a, b, any(_under(k, p) for p in FIXED)))
    return changes


def check_changes(changes: list[ConfigChange], resume_dir: Path, *, allow: bool) -> None:
    """Refuse a resume whose config changes what the run means, unless ``allow``.

    Raises:
        CheckpointError: a :data:`FIXED` key changed and ``resume_allow_changes`` is false; one
            line naming the first such key, its two values and the way out.
    """
    fixed = [c for c in changes if c.fixed]
    if not fixed or allow:
        return
    first = fixed[0]
    more = f" (and {', '.join(c.key for c in fixed[1:])})" if len(fixed) > 1 else ""
    raise CheckpointError(
        f"resume_from_checkpoint: {first.key} was {_show(first.saved)} in {resume_dir}, the "
        f"config says {_show(first.new)}{more}; that changes {_fixed_reason(first.key)}, so the "
        "resumed run would not continue the saved one. Set it back, start a new run in another "
        "output_dir, or set resume_allow_changes=true to continue anyway")


def describe_changes(changes: list[ConfigChange], resume_dir: Path) -> str:
    """The block a resume logs: one line per changed key (empty list: one line saying none)."""
    if not changes:
        return f"resuming from {resume_dir}: the config is the one it was saved with"
    lines = [f"resuming from {resume_dir} with {len(changes)} changed config key(s):"]
    lines += [f"  {c.line()}" for c in changes]
    return "\n".join(lines)


def load_saved_config(resume_dir: Path) -> tuple[dict[str, Any], int | None, int]:
    """``(resolved config, global batch, step)`` saved in ``resume_dir/recipe_state.pt``, read
    memory-mapped (the optimizer state in the same file is not read into memory).

    Raises:
        UserError: the file is missing or cannot be read.
    """
    from torchtune_grpo.checkpoints.saving import RECIPE_STATE_FILE, load_recipe_state

    path = Path(resume_dir) / RECIPE_STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError):  # named in one line by the loader
        state = load_recipe_state(resume_dir)
    config = dict(state.get("config") or {})
    config.setdefault("seed", state.get("seed"))
    return config, state.get("global_batch_size"), int(state.get("step", 0))


def apply_optimizer_settings(optimizer: torch.optim.Optimizer,
                             fresh_groups: list[dict[str, Any]], lr_scheduler: Any) -> None:
    """Put the config's hyperparameters back over a restored optimizer and scheduler state.

    ``optimizer.load_state_dict`` brings back the saved run's param-group settings (learning
    rate, betas, weight decay, ...) and the scheduler's its base rates. This sets every
    setting to the freshly built optimizer's (``fresh_groups``, taken before loading), keeps the
    restored moments and step counts, and recomputes the learning rate at the restored schedule
    position with the new base rate and the new schedule (e.g. a new ``num_steps``). With an
    unchanged config every value is the one saved, bitwise.

    Args:
        optimizer: the optimizer after its state was loaded.
        fresh_groups: its ``param_groups`` as built from the config, without ``params``.
        lr_scheduler: the scheduler after its state was loaded, or None.

    Raises:
        ValueError: the restored optimizer has another number of parameter groups.
    """
    groups = optimizer.param_groups
    if len(groups) != len(fresh_groups):
        raise ValueError(f"the saved optimizer has {len(groups)} parameter groups, the config "
                         f"builds {len(fresh_groups)}")
    for group, fresh in zip(groups, fresh_groups):
        for name, value in fresh.items():
            if name != "params":
                group[name] = value
    if lr_scheduler is None:
        return
    base = [g.get("initial_lr", g["lr"]) for g in groups]
    lr_scheduler.base_lrs = list(base)
    epoch = lr_scheduler.last_epoch
    if hasattr(lr_scheduler, "lr_lambdas"):  # LambdaLR: torchtune's schedules
        lrs = [b * lam(epoch) for b, lam in zip(base, lr_scheduler.lr_lambdas)]
    elif hasattr(lr_scheduler, "_get_closed_form_lr"):
        lrs = lr_scheduler._get_closed_form_lr()
    else:
        raise ValueError(f"{type(lr_scheduler).__name__} has no closed form: its learning "
                         "rate cannot be recomputed for a changed config")
    for group, lr in zip(groups, lrs):
        group["lr"] = lr
    lr_scheduler._last_lr = [g["lr"] for g in groups]
