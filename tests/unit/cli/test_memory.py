"""Memory estimator, the single-device configs with a memory budget, and the estimate vs. a
measured peak."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import memory_estimate
from tests.conftest import check_instantiates_offline, config_json_alone
from torchtune_grpo.cli.memory_estimate import (
    DEFAULT_PROMPT_TOKENS,
    FUSED_LOGIT_COPIES,
    GIB,
    LOGIT_COPIES,
    estimate_memory,
    intended_world_size,
    model_dims,
    training_configs,
)
from torchtune_grpo.config.loading import load_config, resolve_config_path
from torchtune_grpo.config.validation import validate_config

ROOT = Path(__file__).resolve().parents[3]
BUDGET_CONFIGS = {
    "grpo/qwen2_5_1_5B_full_single_device": 80,
    "grpo/qwen2_5_3B_lora_single_device": 24,
    "grpo/qwen2_5_0_5B_full_single_device": 24,
}
#: The estimate must leave this share of the device free (CUDA context, fragmentation).
MARGIN = 0.75


def _quickstart(*overrides: str):
    return load_config("grpo/quickstart_cpu", list(overrides))


# ---------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", sorted(BUDGET_CONFIGS))
def test_budget_configs_validate_and_instantiate(name, tmp_path):
    cfg = load_config(name)
    validate_config(cfg)
    folder = config_json_alone(cfg, tmp_path)  # the model comes from its config.json
    check_instantiates_offline(load_config(name, [f"model_dir={folder}"]), min_params=4e8)
    # the weight files and the model type are read from the folder, not named
    assert cfg.checkpointer._component_ == "torchtune_grpo.models.hf_checkpointer"
    assert "checkpoint_files" not in cfg.checkpointer and "model_type" not in cfg.checkpointer


@pytest.mark.parametrize("name,budget_gb", sorted(BUDGET_CONFIGS.items()))
def test_budget_configs_state_their_hardware_and_fit_it(name, budget_gb):
    header = resolve_config_path(name).read_text().split("\n\n")[0]
    assert re.search(rf"Hardware: 1 x {budget_gb} GB", header), header
    assert f"grpo_full_finetune_single_device --config {name}" in header
    assert intended_world_size(name) == 1
    estimate = estimate_memory(load_config(name), 1, name=name)
    assert estimate.peak_bytes < MARGIN * budget_gb * GIB, estimate.table()


def test_lora_config_has_no_reference_copy_and_trains_adapters_only():
    cfg = load_config("grpo/qwen2_5_3B_lora_single_device")
    dims = model_dims(cfg.model)
    assert dims.is_lora and dims.trainable_params < 0.02 * dims.num_params
    estimate = estimate_memory(cfg)
    assert cfg.loss.kl_coeff != 0 and estimate.settings["kl"]
    assert estimate.components["reference_model"] == 0
    assert "reference" in estimate.phases  # the adapters-disabled pass still runs
    assert estimate.components["gradients"] == dims.trainable_params * 2


def test_qwen3_configs_build_through_the_package():
    """torchtune 0.6.1 has no Qwen3 builders (and its q/k norm order is not Qwen3's): shipped
    Qwen3 configs build the model from the folder with this package's builders."""
    shipped = [n for n in training_configs() if "qwen3" in n]
    for name in shipped:
        component = load_config(name).model._component_
        assert component in ("torchtune_grpo.models.hf_model",
                             "torchtune_grpo.models.lora_hf_model"), (name, component)


# ---------------------------------------------------------------------------- estimator
def test_dims_come_from_the_meta_model():
    dims = model_dims(load_config("grpo/qwen2_5_3B_full").model)
    assert (dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (36, 16, 2, 128)
    assert (dims.embed_dim, dims.hidden_dim, dims.vocab_size) == (2048, 11008, 151936)
    assert 3.0e9 < dims.num_params < 3.2e9 and not dims.is_lora


def test_components_follow_dtype_optimizer_and_kl():
    bf16 = estimate_memory(_quickstart("dtype=bf16", "loss.kl_coeff=0.1"))
    fp32 = estimate_memory(_quickstart("dtype=fp32", "loss.kl_coeff=0.1"))
    n = fp32.dims.num_params
    assert fp32.components["weights"] == 4 * n == 2 * bf16.components["weights"]
    assert fp32.components["gradients"] == 4 * n
    # torch AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype
    assert fp32.components["optimizer_state"] == 8 * n
    assert bf16.components["optimizer_state"] == 4 * n
    assert fp32.components["reference_model"] == 4 * n
    no_kl = estimate_memory(_quickstart("loss.kl_coeff=0.0"))
    assert no_kl.components["reference_model"] == 0 and "reference" not in no_kl.phases
    sgd = estimate_memory(_quickstart("optimizer._component_=torch.optim.SGD"))
    assert sgd.components["optimizer_state"] == 0
    cfg = _quickstart("optimizer._component_=torch.optim.SGD")
    cfg.optimizer.momentum = 0.9
    assert estimate_memory(cfg).components["optimizer_state"] == 4 * n


def test_kv_cache_logits_and_prompt_length():
    cfg = _quickstart("batch_size=4", "group_size=8", "forward_batch_size=8",
                      "max_generated_tokens=20", "logprob_chunk_size=64")
    est = estimate_memory(cfg, prompt_tokens=30)
    d = est.dims
    assert est.components["kv_cache"] == 8 * d.num_layers * 2 * d.num_kv_heads * d.head_dim * 50 * 4
    # two reused blocks, and the kept softmax of all 8 x 20 response positions (fits 512 MiB)
    assert est.components["logits"] == (FUSED_LOGIT_COPIES * 64 + 160) * d.vocab_size * 4
    # a budget of whole chunks: 1 MiB holds 819 positions of 320 ids, i.e. 12 chunks of 64;
    # 0 keeps nothing
    cfg.logprob_keep_probs_mib = 0
    assert (estimate_memory(cfg, prompt_tokens=30).components["logits"]
            == FUSED_LOGIT_COPIES * 64 * d.vocab_size * 4)
    big = _quickstart("batch_size=32", "group_size=8", "forward_batch_size=256",
                      "max_generated_tokens=20", "logprob_chunk_size=64",
                      "logprob_keep_probs_mib=1")
    assert (estimate_memory(big, prompt_tokens=30).components["logits"]
            == (FUSED_LOGIT_COPIES + 12) * 64 * d.vocab_size * 4)
    cfg.logprob_keep_probs_mib = 512
    # an entropy bonus differentiates the entropy: the checkpointed path's blocks
    bonus = estimate_memory(_quickstart("batch_size=4", "group_size=8", "forward_batch_size=8",
                                        "max_generated_tokens=20", "logprob_chunk_size=64",
                                        "loss.entropy_coeff=0.01"), prompt_tokens=30)
    assert bonus.components["logits"] == LOGIT_COPIES * 64 * d.vocab_size * 4
    assert estimate_memory(cfg).settings["prompt_tokens"] == 16  # addition prompts are short
    cfg.dataset._component_ = "torchtune_grpo.datasets.gsm8k_dataset"
    assert estimate_memory(cfg).settings["prompt_tokens"] == DEFAULT_PROMPT_TOKENS
    cfg.dataset.max_prompt_tokens = 100
    assert estimate_memory(cfg).settings["prompt_tokens"] == 100


def test_activation_checkpointing_and_micro_batches_cut_activations():
    full = estimate_memory(load_config("grpo/qwen2_5_3B_full",
                                       ["enable_activation_checkpointing=false"]), 8)
    ac = estimate_memory(load_config("grpo/qwen2_5_3B_full"), 8)
    assert ac.components["activations"] < full.components["activations"] / 5
    half = estimate_memory(load_config("grpo/qwen2_5_3B_full", ["forward_batch_size=8"]), 8)
    assert half.components["activations"] < 0.6 * ac.components["activations"]
    # the rollout's rows are rollout_batch_size's, not the update's micro-batch
    assert half.components["kv_cache"] == ac.components["kv_cache"]


def test_world_size_shards_state_and_offload_moves_it_to_the_host():
    one = estimate_memory(load_config("grpo/qwen2_5_3B_full"), 1)
    eight = estimate_memory(load_config("grpo/qwen2_5_3B_full"), 8)
    for key in ("weights", "gradients", "optimizer_state", "reference_model"):
        assert abs(eight.components[key] * 8 - one.components[key]) <= 8, key
    assert eight.components["kv_cache"] == one.components["kv_cache"]  # per-rank rows
    offload = estimate_memory(load_config("grpo/qwen2_5_3B_full", ["fsdp_cpu_offload=true"]), 8)
    assert offload.components["weights"] == 0 and offload.components["optimizer_state"] == 0
    assert offload.host_bytes > 3 * eight.components["weights"]
    assert offload.peak_bytes < eight.peak_bytes


def test_peak_is_the_largest_phase_and_the_table_shows_it():
    est = estimate_memory(load_config("grpo/qwen2_5_3B_full"), 8, name="x")
    assert est.peak_bytes == max(est.phases.values())
    static = sum(est.components[k] for k in ("weights", "optimizer_state", "reference_model"))
    assert est.phases["update"] >= static + est.components["gradients"] + est.components[
        "activations"] + est.components["logits"]
    table = est.table()
    assert "PEAK" in table and "<- peak" in table and "kv_cache" in table
    assert json.loads(json.dumps(est.to_dict()))["peak_gib"] == round(est.peak_gib, 3)


def test_cli_prints_the_breakdown(capsys):
    from torchtune_grpo.cli.main import main

    assert main(["estimate-memory", "--config", "grpo/qwen2_5_3B_lora_single_device"]) == 0
    out = capsys.readouterr().out
    assert "LoRA" in out and "PEAK" in out
    assert main(["estimate-memory", "--config", "grpo/qwen2_5_3B_full", "--world-size", "2",
                 "batch_size=8", "forward_batch_size=64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 2 and data["settings"]["rows"] == 128
    args = ["estimate-memory", "--config", "grpo/qwen2_5_3B_full", "forward_batch_size=7"]
    assert main(args) == 2


def test_benchmark_script_estimates_every_training_config(tmp_path, capsys):
    out = tmp_path / "mem.json"
    assert memory_estimate.main(["--all", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    # every one is sized: from its folder's config.json, else (not downloaded) from the model's
    # known shape, which the row names
    assert {r["config"] for r in rows} == set(training_configs())
    for row in rows:
        folder = load_config(row["config"]).model.get("model_dir")
        absent = folder is not None and not (Path(str(folder)) / "config.json").is_file()
        assert (row["dims"]["source"] is not None) == absent, row["config"]
    assert all(r["peak_bytes"] > 0 for r in rows)
    assert "| grpo/qwen2_5_3B_full | 8 |" in capsys.readouterr().out


# ---------------------------------------------------------------------------- validation
@pytest.mark.slow
def test_estimate_matches_measured_cpu_peak_within_25_percent():
    """Full fine-tuning and LoRA on a 29M-parameter model (weights ~116 MB in fp32)."""
    names = [n for n in memory_estimate.VALIDATION_RUNS if "reference +" not in n]
    rows = memory_estimate.validate(names, threads=2)
    for row in rows:
        assert 0.75 <= row["ratio"] <= 1.25, row


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_child_peak_is_its_own_not_the_parents():
    """A child process started by a large parent reports its own peak, not the parent's.

    Linux carries ``ru_maxrss`` across fork/exec, so after a test has loaded a model, a
    measurement child read the pytest process's peak (3.4 GB for a 0.7 GB run).
    """
    import subprocess
    import sys

    import torch

    ballast = torch.ones(1024**3 // 4)  # 1 GiB resident in this process
    assert ballast.sum() > 0
    code = "from torchtune_grpo.backends.memory import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout.split()[-1])
    from torchtune_grpo.backends.memory import peak_rss_bytes

    assert peak_rss_bytes() > 1024**3
    assert child < 700 * 1024**2, child  # torch alone: ~250 MB


def test_rollout_batch_size_sets_the_rows_of_the_one_kv_cache():
    """``rollout_batch_size`` rows decode at once, each ``P + T`` long; null: all of the
    rank's rows of one rollout call on CUDA, ``forward_batch_size`` (else all) on CPU."""
    name = "grpo/qwen2_5_3B_full"
    base = ["batch_size=4", "group_size=16", "forward_batch_size=16"]
    cuda = estimate_memory(load_config(name, base), 8)
    d, s = cuda.dims, cuda.settings
    per_row = d.num_layers * 2 * d.num_kv_heads * d.head_dim * (s["prompt_tokens"]
                                                                + s["max_generated_tokens"]) * 2
    assert cuda.components["kv_cache"] == 64 * per_row  # all 4 x 16 rows, not 16
    assert s["generation_rows"] == 64 and f"{64} rows decoded at once" in cuda.table()
    set16 = estimate_memory(load_config(name, [*base, "rollout_batch_size=16"]), 8)
    assert set16.components["kv_cache"] == 16 * per_row
    assert set16.phases["rollout"] <= cuda.phases["rollout"] - 48 * per_row  # + sampling
    accum = estimate_memory(load_config(name, [*base, "gradient_accumulation_steps=2"]), 8)
    assert accum.components["kv_cache"] == 32 * per_row  # a rollout call holds half the rows
    cpu = estimate_memory(load_config(name, [*base, "device=cpu"]), 8)
    assert cpu.components["kv_cache"] == 16 * per_row  # forward_batch_size on CPU
    every = estimate_memory(load_config(name, [*base[:2], "forward_batch_size=null",
                                               "device=cpu"]), 8)
    assert every.components["kv_cache"] == 64 * per_row


def test_fsdp_root_head_gradient_and_runtime_are_counted():
    """Under FSDP2 the root's group (embedding, final norm) is gathered through the update with
    its gradient; the fused log-prob backward accumulates a float32 ``[V, D]`` weight gradient
    (and, in bf16, a chunk product and its float32 copy); each CUDA process holds its context
    and, with several ranks, NCCL's buffers."""
    from torchtune_grpo.cli.memory_terms import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES

    name = "grpo/qwen2_5_3B_full"
    eight = estimate_memory(load_config(name), 8)
    d = eight.dims
    vd = d.vocab_size * d.embed_dim
    assert d.root_params == vd + d.embed_dim == d.root_trainable  # tied embedding + final norm
    assert eight.components["fsdp_root"] == 2 * d.root_params * 2  # bf16 weights + gradient
    assert eight.components["head_weight_grad"] == vd * (4 + 2 + 4)
    assert eight.components["cuda_runtime"] == CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES
    static = sum(eight.components[k] for k in ("weights", "optimizer_state", "cuda_runtime"))
    assert eight.phases["update"] >= static + sum(eight.components[k] for k in (
        "gradients", "activations", "logits", "head_weight_grad")) + d.root_params * 2
    assert eight.allocated_peak_bytes == eight.peak_bytes - eight.components["cuda_runtime"]
    one = estimate_memory(load_config(name, ["batch_size=4"]), 1)
    assert one.components["fsdp_root"] == 0 and one.components["cuda_runtime"] == (
        CUDA_CONTEXT_BYTES)
    fp32 = estimate_memory(load_config(name, ["dtype=fp32"]), 8)
    assert fp32.components["head_weight_grad"] == 4 * vd  # addmm_ into the accumulator
    bonus = estimate_memory(load_config(name, ["loss.entropy_coeff=0.01"]), 8)
    assert bonus.components["head_weight_grad"] == 2 * vd  # autograd's chunk gradient
    lora = estimate_memory(load_config("grpo/qwen2_5_3B_lora_single_device"))
    assert lora.components["head_weight_grad"] == 0  # the output weight is frozen
    cpu = estimate_memory(load_config(name, ["device=cpu", "forward_batch_size=64"]), 8)
    assert cpu.components["cuda_runtime"] == 0
    # a bf16 model on CPU: the float32 logits upcast the hidden rows and the weight block-wise
    from torchtune_grpo.policy.logprobs import UPCAST_BLOCK_ELEMENTS

    rows = max(cpu.settings["logprob_chunk_size"], cpu.settings["generation_rows"])
    assert cpu.components["fp32_output_weight"] == 4 * (UPCAST_BLOCK_ELEMENTS
                                                         + rows * d.embed_dim)
    assert eight.components["fp32_output_weight"] == 0
    table = eight.table()
    for component in eight.components:  # every line says what it counts
        line = next(ln for ln in table.splitlines() if ln.split()[:1] == [component])
        assert len(line.split()) > 3, line


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_fused_head_backward_memory_is_what_the_estimate_counts():
    """The fused log-prob backward's memory beyond its inputs, measured (peak RSS of a fresh
    CPU process, freed blocks returned to the system) against ``head_weight_grad_bytes``, in
    bf16 and fp32: a CPU measurement of the allocations the same code makes on CUDA."""
    import os
    import subprocess
    import sys

    from torchtune_grpo.cli.memory_terms import head_weight_grad_bytes

    v, d = 16384, 512
    code = f"""
import resource, torch
from torchtune_grpo.backends.memory import peak_rss_bytes
from torchtune_grpo.policy.logprobs import _FusedLinearLogProbs
def logprobs(v, d, dtype):  # 64 positions in chunks of 16, no softmax kept
    w = torch.randn(v, d, dtype=dtype, requires_grad=True)
    h = torch.randn(64, d, dtype=dtype, requires_grad=True)
    y = torch.randint(0, v, (64,))
    return _FusedLinearLogProbs.apply(h, w, y, None, 1.0, 16, False, 0)[0]
for dtype in (torch.bfloat16, torch.float32):
    logprobs(64, 32, dtype).sum().backward()  # one-off costs first (thread pools, kernels)
    logp = logprobs({v}, {d}, dtype)
    open('/proc/self/clear_refs', 'w').write('5')  # the peak (VmHWM) restarts here
    with open('/proc/self/statm') as f:
        base = int(f.read().split()[1]) * resource.getpagesize()
    logp.sum().backward()
    print(peak_rss_bytes() - base)
    del logp
"""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    for measured, b, per_element in zip(map(int, out[-2:]), (2, 4), (10, 4)):
        expected = head_weight_grad_bytes(v, d, b, fused=True, trainable=True)
        # plus the chunk blocks and the hidden states' gradient (~4%)
        assert expected <= measured <= 1.1 * expected, (measured / (v * d), b)
        assert expected == per_element * v * d


def test_rollout_holds_the_gathered_weights_under_fsdp():
    """``rollout_gather_weights`` (default): the rollout and reference phases of a sharded run
    hold one full copy of the weights; off, FSDP's two gathered layers; no effect on 1 rank."""
    name = "grpo/qwen2_5_3B_full"
    dims = model_dims(load_config(name).model)
    full_copy = dims.num_params * 2  # bf16
    layers = (2 * dims.layer_params + dims.root_params) * 2  # and the root's group, all along
    on = estimate_memory(load_config(name, ["loss.kl_coeff=0.05"]), 8)
    off = estimate_memory(load_config(name, ["loss.kl_coeff=0.05",
                                             "rollout_gather_weights=false"]), 8)
    assert on.settings["rollout_gather_weights"] and not off.settings["rollout_gather_weights"]
    assert on.components["gathered_weights"] == full_copy
    assert off.components["gathered_weights"] == 0
    for phase in ("rollout", "reference"):
        assert on.phases[phase] - off.phases[phase] == pytest.approx(full_copy - layers, abs=8)
    assert on.phases["update"] == off.phases["update"]  # freed before the update
    assert on.phases["reference"] > off.phases["reference"] and on.peak_bytes >= off.peak_bytes
    # a vLLM engine does not run the policy during the rollout: only the reference pass gathers
    vllm = estimate_memory(load_config(name, [
        "loss.kl_coeff=0.05",
        "generator._component_=torchtune_grpo.rollout.vllm_engine.VLLMGenerator"]), 8)
    assert vllm.phases["rollout"] == off.phases["rollout"]
    assert vllm.phases["reference"] == on.phases["reference"]
    one = [estimate_memory(load_config(name, ["batch_size=4", f"rollout_gather_weights={g}"]), 1)
           for g in ("true", "false")]
    assert one[0].phases == one[1].phases and one[0].components["gathered_weights"] == 0


def test_tools_size_the_kv_cache_for_the_models_context():
    """A multi-turn rollout re-prefills a row's whole sequence each turn, so a turn's cache
    may hold up to ``max_seq_len`` positions per row, not ``P + T``."""
    import json

    base = ("batch_size=4", "group_size=8", "forward_batch_size=8", "max_generated_tokens=20")
    calculator = "torchtune_grpo.rollout.tools.calculator.Calculator"
    tools = "tools=" + json.dumps([{"_component_": calculator}])
    plain = estimate_memory(_quickstart(*base), prompt_tokens=30)
    multi = estimate_memory(_quickstart(*base, tools), prompt_tokens=30)
    d = multi.dims
    assert d.max_seq_len == 256 and multi.settings["kv_positions"] == 256
    assert plain.settings["kv_positions"] == 50
    per_position = 8 * d.num_layers * 2 * d.num_kv_heads * d.head_dim * 4
    assert plain.components["kv_cache"] == per_position * 50
    assert multi.components["kv_cache"] == per_position * 256
    assert multi.peak_bytes >= plain.peak_bytes


def test_rollout_counts_the_packed_weights_on_cpu_only():
    """The native engine's oneDNN-reordered weights (CPU, fp32, one process): one more copy of
    the body's linear weights and the output projection during the rollout."""
    cfg = _quickstart("device=cpu", "dtype=fp32")
    d = estimate_memory(cfg).dims
    packed = estimate_memory(cfg).components["packed_weights"]
    assert packed == (d.num_layers * d.layer_params + d.vocab_size * d.embed_dim) * 4
    off = estimate_memory(_quickstart("device=cpu", "dtype=fp32",
                                      "generator.packed_weights=false"))
    assert off.components["packed_weights"] == 0
    assert estimate_memory(cfg).phases["rollout"] - off.phases["rollout"] == packed
    assert estimate_memory(_quickstart("device=cuda", "dtype=fp32")).components[
        "packed_weights"] == 0
