"""``tune run`` with ``generator: VLLMGenerator``: trains, syncs every step, and a run whose syncs
are skipped shows it in ``generation/logprob_diff_max``.

Needs vLLM (skipped when it does not import); see the README's "vLLM tests" command.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from tests.recipes._helpers import metrics, quickstart_overrides, run_tune  # noqa: E402
from torchtune_grpo.quickstart.tiny import (  # noqa: E402
    TINY_MODEL_DIMS,  # noqa: E402
    tiny_llama,
    tiny_tokenizer,
    write_hf_checkpoint,
)

#: vLLM's CPU attention needs head_dim >= 32 (the quickstart model has 16).
DIMS = dict(TINY_MODEL_DIMS, embed_dim=128, num_heads=2, num_kv_heads=1)
VLLM = "torchtune_grpo.rollout.vllm_engine.VLLMGenerator"
TOLERANCE = 1e-3  # as in test_vllm_generator.py


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm_base")
    torch.manual_seed(0)
    model = tiny_llama(**DIMS)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # small weights: a sampled, not near-greedy, start
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name
                    else torch.randn(p.shape, generator=g) * 0.08)
    tiny_tokenizer(path)
    write_hf_checkpoint(model, path, DIMS)
    return path


def _run(base, out, *extra, nproc: int = 1):
    launcher = (["--nproc_per_node", str(nproc), "grpo_full_finetune_distributed"] if nproc > 1
                else ["grpo_full_finetune_single_device"])
    run_tune(["run", *launcher,
              *quickstart_overrides(base, out, "model.embed_dim=128", "model.num_heads=2",
                                    "model.num_kv_heads=1", "num_steps=4", "batch_size=4",
                                    "group_size=4", "max_generated_tokens=6",
                                    # a reward that varies within every group: the policy moves
                                    "rewards=[{_component_: components.length_reward}]",
                                    *extra)],
             cwd=out.parent, timeout=900, threads=2 // nproc)
    return metrics(out)


def test_vllm_generator_trains_and_stays_in_sync(base, tmp_path):
    rows = _run(base, tmp_path / "synced", f"generator._component_={VLLM}")
    assert len(rows) == 4
    for row in rows:
        assert row["generation/logprob_diff_max"] < TOLERANCE, row
        assert row["time/weight_sync"] > 0
    assert all(row["grad_norm"] > 0 for row in rows)  # the policy moved at every step
    assert (tmp_path / "synced" / "step_4").is_dir()
    # resumed: the engine starts from the base model's folder, so the first rollout is only
    # right if setup synced the step-4 weights into it
    rows = _run(base, tmp_path / "synced", f"generator._component_={VLLM}", "num_steps=5",
                "resume_from_checkpoint=true")
    assert rows[-1]["step"] == 5
    assert rows[-1]["generation/logprob_diff_max"] < TOLERANCE, rows[-1]


def test_skipped_sync_is_visible_in_the_logprob_gap(base, tmp_path):
    rows = _run(base, tmp_path / "stale",
                "generator._component_=components.VLLMGeneratorWithoutSync")
    assert rows[0]["generation/logprob_diff_max"] < TOLERANCE  # first rollout: base weights
    assert max(r["generation/logprob_diff_max"] for r in rows[1:]) > 10 * TOLERANCE


def test_one_engine_per_rank_under_fsdp(base, tmp_path):
    """Two processes: FSDP2-sharded policy, one vLLM engine per rank, gathered weight syncs."""
    rows = _run(base, tmp_path / "fsdp", f"generator._component_={VLLM}", "num_steps=3",
                nproc=2)
    assert len(rows) == 3
    for row in rows:  # the max over both ranks' tokens
        assert row["generation/logprob_diff_max"] < TOLERANCE, row
    assert all(row["grad_norm"] > 0 for row in rows)


def test_lora_policy_is_merged_into_the_engine(base, tmp_path):
    """LoRA: the engine receives base + adapters (merged) after every update."""
    lora = ["model._component_=torchtune.models.llama3_2.lora_llama3_2",
            "model.lora_attn_modules=[q_proj,v_proj,output_proj]", "model.lora_rank=4",
            "model.lora_alpha=8", "model.apply_lora_to_mlp=true", "optimizer.lr=1e-2"]
    rows = _run(base, tmp_path / "lora", f"generator._component_={VLLM}", "num_steps=3", *lora)
    assert all(row["grad_norm"] > 0 for row in rows)
    for row in rows:
        assert row["generation/logprob_diff_max"] < TOLERANCE, row
