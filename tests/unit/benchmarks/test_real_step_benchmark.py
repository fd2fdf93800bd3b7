"""``benchmarks.real_step``: its command line, the TRL install hint, and the bound helpers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import harness, real_step

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess:
    """The script as a command (``python -m benchmarks.real_step``), with ``args``."""
    return subprocess.run([sys.executable, "-m", "benchmarks.real_step", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_help():
    """``--help`` documents the peer and the shape options and exits 0."""
    out = _run("--help")
    assert out.returncode == 0
    for option in ("--peer", "--peer-python", "--steps", "--new-tokens", "--threads",
                   "--model-dir", "--out"):
        assert option in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "positive integer"),
    (["--new-tokens", "x"], "positive integer"),
    (["--threads", "-1"], "positive integer"),
    (["--peer", "vllm"], "invalid choice"),
])
def test_argument_errors_are_clear(args, message):
    """Bad arguments exit 2 with argparse's message naming the problem."""
    out = _run(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_missing_trl_venv_exits_2_with_the_install_hint(tmp_path):
    """``--peer trl`` with a Python that does not exist says how to install TRL, exits 2,
    before any model is needed."""
    out = _run("--peer", "trl", "--peer-python", str(tmp_path / "nope" / "python"),
               "--model-dir", str(tmp_path / "no-model"))
    assert out.returncode == 2
    assert "benchmarks/peers/setup_trl.sh" in out.stderr
    assert "does not exist" in out.stderr


def test_missing_model_exits_2_with_the_prepare_hint(tmp_path):
    """Without the HF folder the script says how to make it and exits 2."""
    out = _run("--model-dir", str(tmp_path / "no-model"))
    assert out.returncode == 2
    assert "tune-grpo prepare-model smollm2" in out.stderr


def test_decode_schedule_follows_the_rows_still_running():
    """Ideal rows count only running rows; the engine's keep the stopped ones until 25% stop."""
    sched = real_step.decode_schedule([2, 4, 4, 4], [True, True, False, True], max_new=4,
                                   micro_batch=4)
    # calls for tokens 1, 2, 3 (max length 4): after token 1 row 0 (L=2) has stopped
    assert sched["ideal"] == [4, 3, 3]
    assert sched["engine"] == [4, 3, 3]  # 1 of 4 stopped >= max(1, 0.25 x 4): shrink
    # two micro-batches of 2: the second never stops before the limit
    sched = real_step.decode_schedule([1, 3, 3, 3], [True, True, False, False], max_new=3,
                                   micro_batch=2)
    assert sched["ideal"] == [1, 1, 2, 2]
    assert len(sched["engine"]) == 4 and all(e >= i for e, i in zip(sched["engine"],
                                                                      sched["ideal"]))


def test_decode_schedule_spans_and_the_timed_attention():
    """Each decode call attends over the padded prompt plus the tokens so far; the timed
    attention grows with the cache length and is interpolated between the timed lengths."""
    from torchtune_grpo.quickstart.tiny import tiny_llama

    sched = real_step.decode_schedule([2, 4, 4, 4], [True, True, False, True], max_new=4,
                                   micro_batch=2, prompt_lengths=[3, 5, 7, 2])
    assert sched["span"] == [6, 7, 8, 8, 9, 10]  # P = 5, then 7; 3 calls each (max length 4)
    assert "span" not in real_step.decode_schedule([2], [True], max_new=4, micro_batch=1)
    torch.manual_seed(0)
    # a span long enough that reading the cache outweighs the call overhead of the tiny model
    # (at 2048 positions the two were within timing noise on a loaded CI machine)
    # timings on a shared CI machine: an inverted pair is measured again (up to 3 times); a
    # span that does not cost more every time is a real failure
    for _ in range(3):
        timed = real_step.decode_attention_seconds(tiny_llama(), [1, 2], [8, 65536], repeats=3)
        assert set(timed) == {(1, 8), (1, 65536), (2, 8), (2, 65536)}
        assert all(t > 0 for t in timed.values())
        if timed[(2, 65536)] > timed[(2, 8)]:
            break
    assert timed[(2, 65536)] > timed[(2, 8)], timed
    fake = {(1, 10): 1.0, (1, 20): 2.0, (1, 40): 3.0}
    assert real_step.interpolate_attention(fake, 1, 15) == pytest.approx(1.5)
    assert real_step.interpolate_attention(fake, 1, 30) == pytest.approx(2.5)
    assert real_step.interpolate_attention(fake, 1, 60) == pytest.approx(4.0)  # extended
    assert real_step.interpolate_attention({(1, 10): 1.0}, 1, 99) == 1.0


def test_phase_bounds_on_a_tiny_model_are_positive_and_consistent():
    """The FLOP, bandwidth and timed-matmul bounds of a tiny model agree with their parts."""
    from torchtune_grpo.quickstart.tiny import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    decode_s = real_step.decode_step_seconds(model, [1, 2, 3, 4], repeats=2)
    assert all(s > 0 for s in decode_s.values())
    if torch.backends.mkldnn.is_available():  # the engine's packed-weight kernel, timed too
        onednn = real_step.decode_step_seconds(model, [1, 4], repeats=2, kernel="onednn")
        assert set(onednn) == {1, 4} and all(s > 0 for s in onednn.values())
    with pytest.raises(ValueError, match="kernel"):
        real_step.decode_step_seconds(model, [1], repeats=1, kernel="mkl")
    kwargs = dict(group_size=2, max_new=6, micro_batch=4, flops_per_second=1e10,
                  read_bytes_per_second=1e10, decode_seconds=decode_s)
    b = real_step.phase_bounds(model, [5, 5, 3, 3], [6, 2, 4, 6], [False, True, True, False],
                            **kwargs)
    params = sum(p.numel() for p in model.parameters())
    assert b["params"] == params and b["weight_bytes"] == 4 * params
    assert b["real_tokens"] == 16 + 18 and b["generated_tokens"] == 18
    assert b["decode_calls"] == 5
    for key in ("prefill_s", "decode_bandwidth_s", "decode_matmul_s", "update_s",
                "update_6np_s", "reference_s"):
        assert b[key] > 0, key
    assert b["update_gflop"] == pytest.approx(3 * b["reference_gflop"])
    assert b["update_6np_gflop"] == pytest.approx(6 * params * 34 / 1e9)
    assert b["decode_bandwidth_s"] == pytest.approx(5 * 4 * params / 1e10)
    assert b["generation_matmul_s"] == pytest.approx(b["prefill_s"] + b["decode_matmul_s"])
    assert b["generation_bandwidth_s"] == pytest.approx(b["prefill_s"]
                                                        + b["decode_bandwidth_s"])
    assert b["decode_matmul_engine_s"] >= b["decode_matmul_s"]
    assert b["decode_row_steps_ideal"] == 4 + 3 + 3 + 2 + 2
    assert "decode_attention_s" not in b
    attention = {(r, s): 0.001 * r for r in (1, 2, 3, 4) for s in (5, 11)}
    with_attention = real_step.phase_bounds(model, [5, 5, 3, 3], [6, 2, 4, 6],
                                         [False, True, True, False],
                                         **{**kwargs, "attention_seconds": attention})
    assert with_attention["decode_attention_s"] == pytest.approx(0.001 * (4 + 3 + 3 + 2 + 2))
    # twice the flop rate halves every FLOP bound
    faster = real_step.phase_bounds(model, [5, 5, 3, 3], [6, 2, 4, 6],
                                 [False, True, True, False],
                                 **{**kwargs, "flops_per_second": 2e10})
    assert faster["update_s"] == pytest.approx(b["update_s"] / 2)
    assert faster["prefill_s"] == pytest.approx(b["prefill_s"] / 2)


def test_memory_read_bandwidth_is_positive():
    """The bandwidth probe returns a positive rate on a small tensor."""
    assert harness.memory_read_bytes_per_second(mib=8, repeats=2) > 0


def test_update_matmul_seconds_grows_with_the_tokens():
    """The timed update bound times real matmuls: 32x the tokens take longer."""
    from torchtune_grpo.quickstart.tiny import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(vocab_size=512)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no thread-pool waits on a busy machine: the matmuls dominate
    try:
        small = real_step.update_matmul_seconds(model, 64, 16, repeats=2)
        large = real_step.update_matmul_seconds(model, 4096, 1024, repeats=2)
    finally:
        torch.set_num_threads(threads)
    assert 0 < small < large


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_family_folder_in_the_benchmark_shape_loads_everywhere(tmp_path, family):
    """``--family qwen3`` / ``llama``: a random folder of the family with the given dimensions
    and the source folder's tokenizer; our builder and transformers load it with the same
    logits; a second call reuses it."""
    transformers = pytest.importorskip("transformers")
    from torchtune import training

    from benchmarks.family_shapes import random_family_folder
    from tests.unit.rewards._learned_models import write_chat_tokenizer
    from torchtune_grpo.models import hf_checkpointer, hf_model

    source = tmp_path / "smollm2"
    source.mkdir()
    write_chat_tokenizer(source)
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                 max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=True)
    out = random_family_folder(source, family, tmp_path / "q3", shape=shape)
    assert (out / "tokenizer.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(theirs).__name__ == {"qwen3": "Qwen3ForCausalLM",
                                     "llama": "LlamaForCausalLM"}[family]
    ours = hf_model(str(out))
    ours.load_state_dict(hf_checkpointer(str(out)).load_checkpoint()[training.MODEL_KEY])
    tokens = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs.eval()(tokens).logits
        assert want.abs().max() > 0
        torch.testing.assert_close(ours.eval()(tokens), want, atol=1e-5, rtol=1e-5)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    random_family_folder(source, family, tmp_path / "q3", shape=shape)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
