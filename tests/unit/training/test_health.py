"""Run health (torchtune_grpo.training.health) on synthetic metric streams."""

from __future__ import annotations

import pytest

from torchtune_grpo.config.settings import HealthSettings, settings_from_config
from torchtune_grpo.training.health import CONDITIONS, INFO_CONDITIONS, RunHealth


def _feed(health: RunHealth, rows: list[dict[str, float]]):
    flags, said = [], []
    for step, row in enumerate(rows, start=1):
        f, w = health.update(step, row)
        flags.append(f)
        said.extend(w)
    return flags, said


def _row(zero=0.5, success=0.1, length=40.0, **rewards):
    row = {"zero_std_group_fraction": zero, "success_rate": success,
           "response_length/mean": length, "reward/mean": success,
           "reward/correctness": success}
    row.update({f"reward/{k}": v for k, v in rewards.items()})
    return row


def test_a_learning_run_raises_nothing():
    health = RunHealth(HealthSettings(window=3), success_component="correctness")
    rows = [_row(zero=0.5, success=0.1 + 0.02 * i, length=40 - i, format=0.2 + 0.03 * i)
            for i in range(20)]
    flags, said = _feed(health, rows)
    assert said == []
    assert all(v == 0.0 for f in flags for v in f.values())
    assert set(flags[-1]) == {f"health/{name}" for name in (*CONDITIONS, *INFO_CONDITIONS)}
    assert "no warnings" in health.summary()


def test_no_signal_fires_once_spans_and_clears():
    health = RunHealth(HealthSettings(window=3, no_signal_fraction=0.9))
    zeros = [0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2]
    flags, said = _feed(health, [_row(zero=z) for z in zeros])
    on = [f["health/no_signal"] for f in flags]
    # window means: step 5 = (0.5+1+1)/3 < 0.9, step 6 = 1.0 ... step 9 = (1+1+0.2)/3 < 0.9
    assert on == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    assert len(said) == 1 and said[0].startswith("step 6: no learning signal")
    assert "group_size" in said[0] and "dynamic_sampling" in said[0]
    assert health.spans["no_signal"] == [[6, 8]]
    assert "no_signal: steps 6-8" in health.summary()


def test_all_right_ties_are_the_task_solved_not_a_missing_signal():
    """The quickstart from step ~22 on: every group tied because every completion was right
    (success 0.97). That is said once, at INFO; it is not the no-signal warning, which needs
    groups that tie without being all right."""
    health = RunHealth(HealthSettings(window=3, no_signal_fraction=0.9))
    rows = [_row(zero=0.5, success=0.3)] * 3 + [
        {**_row(zero=1.0, success=0.97), "solved_group_fraction": 0.95}] * 10
    flags, said = _feed(health, rows)
    assert said == [] and health.spans["no_signal"] == []
    assert [f["health/solved"] for f in flags][4:6] == [0.0, 1.0]
    assert health.info_spans["solved"] == [[6, 13]]
    assert "no warnings" in health.summary() and "solved on the training prompts from step 6" \
        in health.summary()
    # the same ties with every completion wrong: the warning
    health = RunHealth(HealthSettings(window=3, no_signal_fraction=0.9))
    rows = [_row(zero=0.5)] * 3 + [{**_row(zero=1.0, success=0.0),
                                    "solved_group_fraction": 0.0}] * 10
    flags, said = _feed(health, rows)
    assert len(said) == 1 and "no learning signal: 100%" in said[0]
    assert "all right in 0%" in said[0] and health.info_spans["solved"] == []
    # every group tied, 40% all right and 60% all wrong: no gradient, and not solved: warned
    health = RunHealth(HealthSettings(window=3, no_signal_fraction=0.9))
    flags, said = _feed(health, [{**_row(zero=1.0), "solved_group_fraction": 0.4}] * 8)
    assert len(said) == 1 and "all right in 40%" in said[0]
    assert health.info_spans["solved"] == []


def test_the_documented_failure_fires_length_collapse_and_hacking():
    """The SmolLM2/GSM8K run of docs/smollm2_gsm8k.md: format 0.2 -> 1.0, length 144 -> 41
    tokens, correctness flat near 0."""
    health = RunHealth(HealthSettings(window=5), success_component="correctness")
    rows = []
    for i in range(45):
        t = i / 44
        rows.append(_row(zero=0.5 + 0.5 * t, success=0.0 if i != 3 else 1 / 16,
                         length=144 - 103 * t, answer_phrase_format=0.22 + 0.78 * t))
    flags, said = _feed(health, rows)
    kinds = {w.split(": ", 1)[1].split(":")[0] for w in said}
    assert {"response length collapse", "possible reward hacking"} <= kinds
    hacking = next(w for w in said if "reward hacking" in w)
    assert "reward/answer_phrase_format" in hacking
    assert flags[-1]["health/length_collapse"] == 1.0
    assert flags[-1]["health/reward_hacking"] == 1.0


def test_rising_success_silences_length_and_hacking():
    health = RunHealth(HealthSettings(window=5, min_success_gain=0.05),
                       success_component="correctness")
    rows = [_row(success=0.05 + 0.02 * i, length=100 - 3 * i, answer_phrase_format=0.1 + 0.03 * i)
            for i in range(25)]
    _, said = _feed(health, rows)
    assert said == []


def test_the_success_component_is_never_called_hacking():
    health = RunHealth(HealthSettings(window=2, min_success_gain=0.5),
                       success_component="correctness")
    rows = [_row(success=0.0) for _ in range(2)] + [
        {**_row(success=0.0), "reward/correctness": 0.4} for _ in range(4)]
    _, said = _feed(health, rows)
    assert not any("hacking" in w for w in said)


def test_a_gated_component_is_never_called_hacking():
    """A ``requires_success`` term pays only with a right answer: the rung (c) GSM8K run saw
    its logged, ungated value (replies ending on the answer sentence) rise 0.17 -> 0.35 while
    success stayed flat, and nothing paid a wrong answer for it. The same stream with an
    ungated term of that name is still flagged."""
    rows = [_row(success=0.05, length=140 - i, format=0.17 + 0.01 * i) for i in range(30)]
    gated = RunHealth(HealthSettings(window=5), success_component="correctness",
                      gated_components=["format"])
    _, said = _feed(gated, rows)
    assert not any("hacking" in w for w in said)
    ungated = RunHealth(HealthSettings(window=5), success_component="correctness")
    _, said = _feed(ungated, rows)
    assert any("reward/format rose" in w for w in said)


@pytest.mark.parametrize("block, key", [
    ({"window": 0}, "window"), ({"no_signal_fraction": 1.5}, "no_signal_fraction"),
    ({"length_collapse_ratio": 1.0}, "length_collapse_ratio"),
    ({"min_success_gain": -1}, "min_success_gain"), ({"hacking_rise": 0}, "hacking_rise"),
    ({"windw": 3}, "window"),
])
def test_bad_settings_name_the_key(block, key):
    with pytest.raises(ValueError, match=key):
        settings_from_config(HealthSettings, block, "run_health")


def test_plot_shades_the_health_steps(tmp_path):
    """``tune-grpo plot`` shades the steps where a condition held; the length axis starts at 0."""
    pytest.importorskip("matplotlib")  # not in the GPU machine's device kit (too big)
    from torchtune.training.metric_logging import DiskLogger

    from torchtune_grpo.cli.plot import health_spans, plot_run

    logger = DiskLogger(log_dir=str(tmp_path / "logs"))
    health = RunHealth(HealthSettings(window=2))
    for step in range(1, 11):
        row = _row(zero=1.0 if 4 <= step <= 7 else 0.3, length=4.99 + 0.01 * (step % 2))
        flags, _ = health.update(step, row)
        logger.log_dict({**row, **flags}, step=step)
    logger.close()
    from torchtune_grpo.training.metrics import read_disk_log

    rows = read_disk_log(tmp_path / "logs")
    assert health_spans(rows) == {"no_signal": [(5, 7)]}  # window of 2: steps 4-7 all 1.0
    out = plot_run(tmp_path)
    assert out.exists() and out.stat().st_size > 10_000
