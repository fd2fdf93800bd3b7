"""A step folder is complete on its own; damage is found without loading; one run per folder."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torchtune_grpo.checkpoints.run_lock import FolderInUseError, FolderLock, is_locked
from torchtune_grpo.checkpoints.saving import resolve_resume, save_step_checkpoint
from torchtune_grpo.checkpoints.step_folder import (
    check_step_folder,
    model_folder_files,
    safetensors_problem,
    write_missing_files,
)
from torchtune_grpo.errors import UserError


class WeightsOnlyCheckpointer:
    """Writes like torchtune's HF checkpointer that loaded from a folder which is gone since:
    weights and index only, no config.json, no tokenizer (what a resumed run wrote before)."""

    def __init__(self, output_dir: Path):
        self._output_dir = output_dir

    def save_checkpoint(self, state_dict, epoch, adapter_only=False):
        folder = Path(self._output_dir) / f"epoch_{epoch}"
        folder.mkdir(parents=True)
        save_file(state_dict["model"], str(folder / "model-00001-of-00001.safetensors"))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: "model-00001-of-00001.safetensors" for k in state_dict["model"]}}))


def _base_folder(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (base / "tokenizer.json").write_text('{"model": {}}')
    (base / "chat_template.jinja").write_text("{{ messages }}")
    (base / "generation_config.json").write_text("{}")
    save_file({"w": torch.ones(4)}, str(base / "model.safetensors"))
    (base / ".cache").mkdir()
    return base


def _save(out: Path, step: int, files: dict[str, bytes] | None, keep: int | None = None,
          base: Path | None = None) -> Path:
    """A step folder as the recipe writes it; its saved config names ``base`` (the base model
    folder a resume restores missing model files from)."""
    config = {"checkpointer": {"checkpoint_dir": str(base or out / "no_base")},
              "tokenizer": {"_component_": "x.y", "max_seq_len": 8}}
    return save_step_checkpoint(
        output_dir=out, step=step, checkpointer=WeightsOnlyCheckpointer(out),
        checkpoint={"model": {"w": torch.full((4,), float(step))}},
        recipe_state={"step": step, "seed": 0, "config": config}, keep_last_n=keep,
        model_files=files)


def test_model_files_are_the_folders_description_not_its_weights(tmp_path):
    base = _base_folder(tmp_path)
    outside = tmp_path / "tok" / "tokenizer.model"
    outside.parent.mkdir()
    outside.write_bytes(b"ranks")
    files = model_folder_files(base, tokenizer_cfg={"_component_": "x.y", "path": str(outside),
                                                    "max_seq_len": 8})
    assert sorted(files) == ["chat_template.jinja", "config.json", "generation_config.json",
                             "tokenizer.json", "tokenizer.model"]
    assert files["tokenizer.model"] == b"ranks"
    assert model_folder_files(tmp_path / "missing") == {}


def test_every_step_folder_is_complete_whatever_the_checkpointer_copied(tmp_path):
    """The step folders of a resumed run held weights only once the folder it resumed from was
    pruned: now the model files come from the base folder, read when the run starts."""
    base = _base_folder(tmp_path)
    files = model_folder_files(base)
    out = tmp_path / "run"
    for step in (1, 2, 3):
        _save(out, step, files, keep=1)
    step_3 = out / "step_3"
    assert not (out / "step_2").exists()
    for name in files:
        assert (step_3 / name).read_bytes() == files[name]
    report = check_step_folder(step_3)
    assert report.is_step and report.damaged() == [], report.lines()
    # without the model files (the old behaviour) the folder is named unusable
    bare = _save(tmp_path / "old", 1, None)
    assert not check_step_folder(bare).ok("evaluate")
    assert "no config.json" in " ".join(check_step_folder(bare).problems["resume"])


def test_check_finds_truncation_and_missing_files_without_loading(tmp_path):
    base = _base_folder(tmp_path)
    step = _save(tmp_path / "run", 4, model_folder_files(base))
    weights = step / "model-00001-of-00001.safetensors"
    assert safetensors_problem(weights) is None
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 3)
    assert safetensors_problem(weights) == f"truncated: {size - 3:,} of {size:,} bytes"
    report = check_step_folder(step)
    assert not report.ok("resume") and not report.ok("transformers")
    assert "model-00001-of-00001.safetensors is truncated" in report.lines()[1]
    weights.write_bytes(b"\x01")
    assert "not even a header" in safetensors_problem(weights)
    weights.unlink()
    assert any("named by model.safetensors.index.json" in p for p in check_step_folder(step)
               .problems["evaluate"])
    (step / "tokenizer.json").unlink()
    assert any(p.startswith("no tokenizer file") for p in check_step_folder(step)
               .problems["evaluate"])


def test_resume_skips_a_damaged_newest_step_and_says_so(tmp_path, caplog):
    base = _base_folder(tmp_path)
    out = tmp_path / "run"
    files = model_folder_files(base)
    for step in (1, 2):
        _save(out, step, files)
    newest = out / "step_2" / "model-00001-of-00001.safetensors"
    with newest.open("r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    caplog.set_level(logging.WARNING)
    assert resolve_resume(True, out) == out / "step_1"
    assert "step_2 is damaged" in caplog.text and "resuming from step_1" in caplog.text
    with pytest.raises(UserError, match=r"step_2 is damaged \(model-00001-of-00001"):
        resolve_resume(str(out / "step_2"), out)
    (out / "step_1" / "recipe_state.pt").write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(UserError, match="every step folder .* is damaged"):
        resolve_resume(True, out)
    # a folder that only lacks its model files is resumable: the recipe restores them from the
    # base model folder its saved config names; the check says which (the very files written)
    old = _save(tmp_path / "old", 1, None, base=base)
    assert resolve_resume(True, tmp_path / "old") == old
    report = check_step_folder(old)
    assert report.ok("resume") and report.restored == sorted(files) and report.base_dir == base
    assert not report.ok("evaluate") and not report.ok("transformers")  # not restored there
    assert write_missing_files(old, files) == report.restored
    assert write_missing_files(old, files) == []  # never overwrites
    assert check_step_folder(old).damaged() == [] and check_step_folder(old).restored == []


def test_resume_verdict_is_what_the_base_folder_can_restore(tmp_path):
    """No string filtering: a step without config.json is resumable only while its base model
    folder holds an intact one; a damaged config.json in the step is never restored (it is not
    missing), so it stops the resume, as torchtune's checkpointer would."""
    base = _base_folder(tmp_path)
    out = tmp_path / "run"
    step = _save(out, 1, model_folder_files(base), base=base)
    (step / "config.json").unlink()
    assert check_step_folder(step).restored == ["config.json"]
    assert resolve_resume(str(step), out) == step
    (base / "config.json").write_text('{"architectures": ["Llama')  # truncated in the base too
    report = check_step_folder(step)
    assert report.restored == [] and not report.ok("resume")
    assert report.problems["resume"] == [
        f"no config.json (nor an intact one in the base model folder {base})"]
    with pytest.raises(UserError, match=r"step_1 is damaged \(no config.json \(nor an intact"):
        resolve_resume(str(step), out)
    (base / "config.json").unlink()
    assert not check_step_folder(step).ok("resume")
    (step / "config.json").write_text("{")  # present but damaged: not restored, not resumable
    (base / "config.json").write_text("{}")
    report = check_step_folder(step)
    assert report.restored == []
    assert report.problems["resume"] == report.problems["transformers"] == [
        report.problems["evaluate"][0]]
    assert report.problems["resume"][0].startswith("config.json is not valid JSON (")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        resolve_resume(str(step), out)


def test_a_truncated_tokenizer_file_is_damage_for_the_uses_that_read_it(tmp_path):
    """``grpo_eval`` and transformers read a step's tokenizer files; resume reads them only
    where the saved tokenizer config points into the step."""
    base = _base_folder(tmp_path)
    (base / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    step = _save(tmp_path / "run", 1, model_folder_files(base), base=base)
    assert check_step_folder(step).damaged() == []
    tokenizer = step / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:-2])
    report = check_step_folder(step)
    assert report.ok("resume") and not report.ok("evaluate") and not report.ok("transformers")
    (reason,) = report.problems["evaluate"]
    assert reason.startswith("tokenizer.json is not valid JSON (") and "truncated" in reason
    assert report.problems["transformers"] == [reason]
    (step / "tokenizer_config.json").write_text("")
    assert [p.split(" ")[0] for p in check_step_folder(step).problems["evaluate"]] == [
        "tokenizer.json", "tokenizer_config.json"]
    (step / "generation_config.json").write_text("{")  # read by grpo_eval's HF tokenizer only
    report = check_step_folder(step)
    assert "generation_config.json" in " ".join(report.problems["evaluate"])
    assert "generation_config.json" not in " ".join(report.problems["transformers"])
    # a model folder (no marker) is checked the same way
    (base / "vocab.json").write_text('{"a": 1,')
    assert any(p.startswith("vocab.json is not valid JSON")
               for p in check_step_folder(base).problems["evaluate"])
    # resume reads the tokenizer from the step when the saved config points there
    inside = _save(tmp_path / "run2", 1, model_folder_files(base), base=base)
    state = torch.load(inside / "recipe_state.pt", weights_only=True)
    state["config"]["tokenizer"]["path"] = str(inside / "tokenizer.json")
    torch.save(state, inside / "recipe_state.pt")
    assert check_step_folder(inside).ok("resume")
    (inside / "tokenizer.json").write_text('{"model"')
    assert any(p.startswith("tokenizer.json is not valid JSON")
               for p in check_step_folder(inside).problems["resume"])


def _hold(folder: str, ready: mp.Event) -> None:
    lock = FolderLock(folder, "training").acquire()
    ready.set()
    time.sleep(60)
    lock.release()


def test_one_run_per_folder_and_no_stale_lock_after_a_crash(tmp_path):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), ready))
    holder.start()
    try:
        assert ready.wait(60)
        assert is_locked(tmp_path)
        with pytest.raises(FolderInUseError,
                           match=rf"in use by another run \(training, pid {holder.pid} on "):
            FolderLock(tmp_path, "training").acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a crash: no handler, no cleanup
        holder.join()
    assert not is_locked(tmp_path)
    with FolderLock(tmp_path, "grpo_eval") as lock:
        assert lock.held
        info = json.loads(lock.path.read_text())
        assert info["pid"] == os.getpid() and info["purpose"] == "grpo_eval"
    assert not is_locked(tmp_path)


def test_check_step_command_reports_and_exits_1_on_damage(tmp_path, capsys):
    from torchtune_grpo.cli.main import main

    base = _base_folder(tmp_path)
    step = _save(tmp_path / "run", 2, model_folder_files(base))
    assert main(["check-step", str(step)]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  resume_from_checkpoint: ok", "  tune run grpo_eval: ok", "  transformers / vLLM: ok"]
    (step / "config.json").unlink()
    assert main(["check-step", str(step), str(base)]) == 1
    out = capsys.readouterr().out
    assert "resume_from_checkpoint: no: no config.json" in out and f"{base}: model folder" in out
    # the same folder of a run whose base model folder holds config.json: resume restores it
    restorable = _save(tmp_path / "run2", 2, model_folder_files(base), base=base)
    (restorable / "config.json").unlink()
    assert main(["check-step", str(restorable)]) == 1
    assert capsys.readouterr().out.splitlines()[1:] == [
        "  resume_from_checkpoint: ok (config.json is restored from the base model folder "
        f"{base})", "  tune run grpo_eval: no: no config.json",
        "  transformers / vLLM: no: no config.json"]
    tokenizer = restorable / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:5])
    assert main(["check-step", str(restorable)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  resume_from_checkpoint: ok (config.json is restored")
    assert lines[2].startswith("  tune run grpo_eval: no: no config.json; tokenizer.json is not "
                               "valid JSON (")


def test_plot_of_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    from torchtune_grpo.cli.main import main

    assert main(["plot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "no logs/ folder" in err[0]
