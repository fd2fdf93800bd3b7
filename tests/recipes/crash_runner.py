"""Kill training runs at chosen instants of their execution, then resume them (for
``test_crash_consistency.py``).

An *instant* is the K-th Python function call of a run, counted by a ``sys.setprofile`` hook
in the training process itself; at that call the process sends itself SIGKILL (no handler,
no ``finally``, no flush: what a power cut or the OOM killer leaves). Counting calls rather than
seconds makes an instant reproducible and lets a test aim inside the checkpoint writes: with
``phase="save"`` only the calls made while
:func:`torchtune_grpo.checkpoints.saving.save_step_checkpoint` runs are counted.

Run as a script, it reads a JSON spec and writes a JSON result::

    python crash_runner.py SPEC.json RESULT.json

``SPEC``: ``{"config": NAME, "overrides": [...], "reference": DIR, "trials": [{"out": DIR,
"phase": "all" | "save", "fraction": F}, ...]}``. The reference run is trained to the end while
its calls are counted (``counts``: all calls and those inside saves); each trial kills a run at
``K = max(1, int(F * counts[phase]))``, records what the killed run left, then resumes it
(``resume_from_checkpoint=true``) to the end. Every run is a child forked from this process
(which imports the libraries once and never runs a tensor op itself), so a trial costs its
training, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path


def _hook(kill_at: int | None, phase: str, counts: dict[str, int]):
    from torchtune_grpo.checkpoints import saving as checkpointing

    save_code = checkpointing.save_step_checkpoint.__code__
    depth = [0]

    def hook(frame, event, arg):  # noqa: ARG001 (the sys.setprofile signature)
        if event == "return":
            if frame.f_code is save_code:
                depth[0] -= 1
            return
        if event != "call":
            return
        if frame.f_code is save_code:
            depth[0] += 1
        counts["all"] += 1
        if depth[0]:
            counts["save"] += 1
        if kill_at is not None and counts[phase] >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def _run_child(config: str, overrides: list[str], kill_at: int | None = None,
               phase: str = "all", counts_file: str | None = None) -> int:
    """Fork a child that trains (under the counting hook when ``kill_at`` or ``counts_file``
    is given); return its wait status."""
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    code = 1
    try:
        from torchtune_grpo.config.loading import load_config
        from torchtune_grpo.training.recipe import run_recipe

        cfg = load_config(config, overrides)
        counts = {"all": 0, "save": 0}
        if kill_at is not None or counts_file:
            sys.setprofile(_hook(kill_at, phase, counts))
        run_recipe(cfg)
        sys.setprofile(None)
        if counts_file:
            Path(counts_file).write_text(json.dumps(counts))
        code = 0
    except BaseException:  # noqa: BLE001 (report anything, then leave without cleanup)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _state(out: Path) -> dict:
    """What a run left in ``out``: its complete steps, its hidden folders (``.step_N.partial``,
    ``.step_N.deleting``) and the step folders that carry the completion marker but do not load
    (their weights or recipe state missing or unreadable)."""
    from safetensors.torch import load_file

    from torchtune_grpo.checkpoints.saving import list_step_checkpoints, load_recipe_state

    complete = list_step_checkpoints(out)
    broken = []
    for _, path in complete:
        try:
            load_recipe_state(path)
            files = sorted(path.glob("model*.safetensors"))
            if not files:
                raise FileNotFoundError("no model*.safetensors")
            for file in files:
                load_file(str(file))
        except Exception as exc:  # noqa: BLE001 (any failure to load is what we look for)
            broken.append(f"{path.name}: {exc}")
    hidden = sorted(p.name for p in out.glob(".step_*")) if out.is_dir() else []
    return {"complete_steps": [step for step, _ in complete], "hidden": hidden,
            "broken": broken}


def _describe(status: int) -> dict:
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status), "exit": None}
    return {"signal": None, "exit": os.WEXITSTATUS(status)}


def main(spec_file: str, result_file: str) -> None:
    import torchtune_grpo.config.loading  # noqa: F401 (imported once, before the forks)
    import torchtune_grpo.training.recipe  # noqa: F401

    spec = json.loads(Path(spec_file).read_text())
    config, overrides = spec["config"], spec["overrides"]
    result: dict = {"trials": []}

    counts_file = Path(result_file).with_suffix(".counts.json")
    status = _run_child(config, [*overrides, f"output_dir={spec['reference']}"],
                        counts_file=str(counts_file))
    result["reference"] = _describe(status)
    if status != 0:
        Path(result_file).write_text(json.dumps(result))
        return
    counts = json.loads(counts_file.read_text())
    result["counts"] = counts

    for trial in spec["trials"]:
        out = Path(trial["out"])
        kill_at = max(1, int(trial["fraction"] * counts[trial["phase"]]))
        killed = _run_child(config, [*overrides, f"output_dir={out}"], kill_at=kill_at,
                            phase=trial["phase"])
        left = _state(out)
        resumed = _run_child(config, [*overrides, f"output_dir={out}",
                                      "resume_from_checkpoint=true"])
        result["trials"].append({**trial, "kill_at": kill_at, "killed": _describe(killed),
                                 "left": left, "resumed": _describe(resumed),
                                 "after": _state(out)})
        Path(result_file).write_text(json.dumps(result, indent=1))  # as it goes
    Path(result_file).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:3])
