"""Long work reports its phase every 30 s: the line's content and time left, the reporter
thread's cadence, the native engine's decode steps (with no device sync added: counted on
CPU, the property that matters on a GPU), the evaluation's lines and a training step's."""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_grpo.progress import Progress, duration


def test_duration_reads_as_a_person_would():
    assert [duration(s) for s in (4.4, 59.6, 200, 3600 + 5 * 60)] == [
        "4 s", "1 min 00 s", "3 min 20 s", "1 h 05 min"]


def test_a_line_names_the_phase_counts_and_time_left():
    p = Progress(show=False, every_s=30, prefix=lambda: "step 3/60")
    assert p.describe() is None  # between phases
    p.begin("eval", total=100, unit="problems", already=20)
    t0 = p.started
    p.advance(20)  # 20 new problems in 60 s: 60 left take 180 s
    p.decode_batch(2, 3, 512)
    assert "batch 2/3, prefill, up to 512 tokens" in p.describe(t0 + 60)
    p.decode_step(17, 512)
    assert p.describe(t0 + 60) == ("step 3/60: eval, 40/100 problems, batch 2/3, token 17/512 "
                                   "(1 min 00 s, about 3 min 00 s left)")
    p.begin("update", total=8, unit="micro-batches")
    assert p.describe(p.started + 5) == "step 3/60: update, 0/8 micro-batches (5 s)"


def test_a_line_is_due_every_every_s_and_never_between_phases():
    p = Progress(show=False, every_s=30)
    p.begin("rollout of 64 rows")
    t0 = p.started
    assert p.due(t0 + 29) is None
    assert p.due(t0 + 31) == "rollout of 64 rows (31 s)"
    assert p.due(t0 + 50) is None and p.due(t0 + 62) is not None
    p.end()
    assert p.due(t0 + 1000) is None


def test_short_phases_of_long_work_are_reported_and_a_step_line_resets_the_clock(monkeypatch):
    """A step whose phases each take less than every_s still gets a line once it runs longer;
    a line printed elsewhere (the step's own) restarts the 30 s."""
    import torchtune_grpo.progress as progress_module

    clock = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    p = Progress(show=False, every_s=30)
    p.begin("rollout of 64 rows")
    clock[0] += 20
    assert p.due() is None
    p.begin("update", total=8, unit="micro-batches")  # a new phase does not restart the clock
    clock[0] += 11
    assert p.due() == "update, 0/8 micro-batches (11 s)"
    clock[0] += 5
    p.mark()  # the step's own line
    clock[0] += 29
    assert p.due() is None
    clock[0] += 1
    assert p.due() is not None


def test_the_reporter_thread_prints_long_phases_only():
    lines: list[str] = []
    with Progress(every_s=0.05, emit=lines.append) as p:
        p.begin("short")
        p.end()
        time.sleep(0.2)
        assert lines == []
        p.begin("long", total=4, unit="micro-batches")
        p.advance()
        time.sleep(0.3)
    assert lines and all(line.startswith("long, 1/4 micro-batches (") for line in lines)
    n = len(lines)
    time.sleep(0.15)
    assert len(lines) == n  # stopped with the context


class _CountSyncs(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (``.item()``, ``bool(t)``...)."""

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def _request(progress):
    from torchtune_grpo.rollout.protocol import GenerationRequest

    torch.manual_seed(0)
    tokens = torch.randint(3, 300, (2, 5))
    return GenerationRequest(
        tokens, torch.ones_like(tokens, dtype=torch.bool), group_size=4, forward_batch_size=4,
        max_generated_tokens=6, temperature=1.0, stop_tokens=torch.tensor([1]), pad_id=0,
        prompt_seeds=torch.tensor([11, 12]), progress=progress)


def test_the_native_engine_reports_decode_steps_without_a_device_sync(tiny_model):
    """CPU test: counts host syncs with a dispatch mode; reporting must add none (on a GPU
    each would stall the decode loop)."""
    from torchtune_grpo.rollout.native import generate_trajectory

    seen = []

    class Recording(Progress):
        def decode_step(self, step, max_tokens):
            super().decode_step(step, max_tokens)
            seen.append((self.batch, self.batches, step))

    counts, trajs = [], []
    for progress in (None, Recording(show=False)):
        with _CountSyncs() as mode:
            trajs.append(generate_trajectory(tiny_model, _request(progress),
                                             packed_weights=False, shrink_finished=False))
        counts.append(mode.syncs)
    assert torch.equal(trajs[0].tokens, trajs[1].tokens)
    assert counts[0] == counts[1] > 0
    # 8 rows in 2 batches of 4, up to 6 tokens each
    assert {b for b, _, _ in seen} == {1, 2} and {n for _, n, _ in seen} == {2}
    assert [s for b, _, s in seen if b == 1] == list(range(1, len(
        [s for b, _, s in seen if b == 1]) + 1))


def test_an_evaluation_prints_its_progress_while_a_batch_runs(monkeypatch):
    from torchtune_grpo.evaluation import evaluate as ev

    lines: list[str] = []
    monkeypatch.setattr(ev._log, "info", lines.append)
    report = ev.EvalProgress(10, 2, 1, show=True, every_s=0.05)
    try:
        report.update(4)
        report.work.decode_step(3, 64)
        time.sleep(0.3)
    finally:
        report.close()
    assert lines[0] == "eval: 10 problems"
    assert any(line.startswith("eval, 6/10 problems, token 3/64 (") and "left)" in line
               for line in lines[1:]), lines
