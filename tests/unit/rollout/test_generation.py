"""Rollout generation: uniform shapes, no undefined ids, exact log-probs, greedy = argmax."""

from __future__ import annotations

import pytest
import torch

from torchtune_grpo.algorithm.trajectory import Trajectory, concat_trajectories
from torchtune_grpo.policy.forward import response_logprobs
from torchtune_grpo.policy.positions import attention_mask, position_ids
from torchtune_grpo.quickstart.tiny import TINY_TOKENIZER_VOCAB, tiny_llama
from torchtune_grpo.rollout.native import generate_micro_batch, generate_trajectory
from torchtune_grpo.rollout.protocol import GenerationRequest
from torchtune_grpo.rollout.sampling import decode_completions, sample_next_token
from torchtune_grpo.token_rules import (
    allowed_token_mask,
    logit_bias_from_mask,
    safe_decode,
    stop_token_ids,
)


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return tokens, mask


def _fake_traj(n: int, prompt_len: int, response_len: int, pad_id: int = 0) -> Trajectory:
    return Trajectory(
        tokens=torch.randint(1, 100, (n, prompt_len + response_len)),
        prompt_mask=torch.ones(n, prompt_len, dtype=torch.bool),
        response_mask=torch.ones(n, response_len, dtype=torch.bool),
        logprobs=-torch.rand(n, response_len),
        stopped=torch.zeros(n, dtype=torch.bool),
        pad_id=pad_id,
    )


def test_concat_pads_micro_batches_of_different_lengths():
    # the original recipe's crash: torch.cat of [16, 512] and [16, 300] responses
    a, b = _fake_traj(16, 20, 512), _fake_traj(16, 12, 300)
    out = concat_trajectories([a, b])
    assert out.tokens.shape == (32, 20 + 512)
    assert out.response_mask.shape == out.logprobs.shape == (32, 512)
    assert not out.response_mask[16:, 300:].any()
    assert (out.tokens[16:, 20 + 300 :] == 0).all()
    assert not out.prompt_mask[16:, :8].any() and out.prompt_mask[16:, 8:].all()
    torch.testing.assert_close(out.response_tokens[16:, :300], b.response_tokens)


def _varied_prompts(tokenizer, n):
    texts = ["1+2=", "13+27=", "5+5=", "99+1=", "40+2=", "7+70=", "3+33=", "11+1="]
    return [tokenizer.encode(texts[i % len(texts)], add_bos=True, add_eos=False) for i in range(n)]


def test_generation_with_different_prompt_and_stop_lengths_has_uniform_shapes(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False)  # untied: near-uniform next-token logits
    tokens, mask = _left_pad(_varied_prompts(tokenizer, 8), tokenizer.pad_id)
    allowed = allowed_token_mask(tokenizer, 320)
    bias = logit_bias_from_mask(allowed)
    bias[tokenizer.eot_id] = 4.0  # make stopping likely but random: lengths differ
    stops = torch.tensor(stop_token_ids(tokenizer))
    kwargs = dict(max_generated_tokens=24, temperature=1.0, top_k=None, stop_tokens=stops,
                  pad_id=tokenizer.pad_id, logit_bias=bias)
    parts = [
        generate_micro_batch(model, GenerationRequest(tokens[i : i + 4].repeat_interleave(2, 0),
            mask[i : i + 4].repeat_interleave(2, 0), **kwargs),
            seeds=torch.arange(8) + 100 * s)
        for i, s in ((0, 1), (4, 2))
    ]
    lengths = [p.response_len for p in parts]
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=2,
        forward_batch_size=4, prompt_seeds=torch.arange(8), **kwargs))
    assert traj.tokens.shape == (16, tokens.shape[1] + traj.response_len)
    assert traj.response_mask.shape == traj.logprobs.shape == (16, traj.response_len)
    # each row: mask is a prefix; stopped rows end on a stop token; padding after it
    for row in range(16):
        m = traj.response_mask[row]
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        if traj.stopped[row]:
            assert int(traj.response_tokens[row, n - 1]) in stop_token_ids(tokenizer)
        assert (traj.response_tokens[row, n:] == tokenizer.pad_id).all()
    # the separately generated micro-batches really did stop at different steps
    assert len(set(lengths)) > 1 or traj.response_lengths.unique().numel() > 1


def _undefined_id_lover(tokenizer):
    """A model whose output layer strongly prefers ids the tokenizer does not define."""
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False)
    undefined = torch.arange(TINY_TOKENIZER_VOCAB, 320)

    def boost(_module, _inputs, output):
        output = output.clone()
        output[..., undefined] += 100.0
        return output

    model.output.register_forward_hook(boost)
    return model


def test_sampling_never_emits_undefined_ids(tokenizer):
    model = _undefined_id_lover(tokenizer)
    allowed = allowed_token_mask(tokenizer, 320)
    assert not allowed[TINY_TOKENIZER_VOCAB:].any()
    assert allowed[: tokenizer.base_vocab_size].all()
    # control: without the mask, this model samples undefined ids
    logits = model(torch.tensor([[tokenizer.bos_id, 50, 51]]))[:, -1]
    unmasked, _ = sample_next_token(logits.repeat(64, 1), temperature=1.0,
                                    seeds=torch.arange(64))
    assert (unmasked >= TINY_TOKENIZER_VOCAB).all()

    tokens, mask = _left_pad(_varied_prompts(tokenizer, 4), tokenizer.pad_id)
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=4,
        forward_batch_size=8, max_generated_tokens=12, temperature=1.5, top_k=None,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        logit_bias=logit_bias_from_mask(allowed), prompt_seeds=torch.arange(4)))
    generated = traj.response_tokens[traj.response_mask]
    assert generated.numel() > 0
    assert allowed[generated].all()
    texts = decode_completions(tokenizer, traj, allowed)
    assert len(texts) == 16 and all(isinstance(t, str) for t in texts)


def test_safe_decode_of_arbitrary_ids_never_raises(tokenizer):
    allowed = allowed_token_mask(tokenizer, 320)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        ids = torch.randint(-5, 1000, (20,), generator=gen).tolist()
        assert isinstance(safe_decode(tokenizer, ids), str)
        assert isinstance(safe_decode(tokenizer, ids, allowed), str)
    assert safe_decode(tokenizer, [ord("4"), 280, ord("2")]) == "42"


def test_generation_logprobs_equal_training_forward(tokenizer):
    torch.manual_seed(0)
    model = tiny_llama()
    tokens, mask = _left_pad(_varied_prompts(tokenizer, 4), tokenizer.pad_id)
    allowed = allowed_token_mask(tokenizer, 320)
    bias = logit_bias_from_mask(allowed)
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=2,
        forward_batch_size=4, max_generated_tokens=10, temperature=0.7, top_k=None,
        stop_tokens=torch.tensor(stop_token_ids(tokenizer)), pad_id=tokenizer.pad_id,
        logit_bias=bias, prompt_seeds=torch.arange(4)))
    padding = traj.padding_mask
    logprobs, entropy = response_logprobs(
        model, traj.tokens, prompt_len=traj.prompt_len, mask=attention_mask(padding),
        input_pos=position_ids(padding), temperature=0.7, logit_bias=bias, return_entropy=True,
    )
    m = traj.response_mask
    assert (logprobs[m] - traj.logprobs[m]).abs().max() < 1e-4
    assert torch.isfinite(entropy[m]).all()
    # the model's outputs are not views: under FSDP2 they are the root module's outputs, which
    # it hooks for backward (a view made torch warn "returned a view tensor" on every step)
    assert logprobs._base is None and entropy._base is None


def test_greedy_matches_stepwise_argmax_and_ignores_left_padding(tokenizer):
    torch.manual_seed(1)
    model = tiny_llama()
    allowed = allowed_token_mask(tokenizer, 320)
    bias = logit_bias_from_mask(allowed)
    prompts = _varied_prompts(tokenizer, 3)
    tokens, mask = _left_pad(prompts, tokenizer.pad_id)
    stops = torch.tensor(stop_token_ids(tokenizer))
    traj = generate_micro_batch(model, GenerationRequest(tokens, mask, max_generated_tokens=8,
        temperature=0.0, top_k=None, stop_tokens=stops, pad_id=tokenizer.pad_id, logit_bias=bias))
    for row, prompt in enumerate(prompts):
        ids = list(prompt)
        expected = []
        with torch.no_grad():
            for _ in range(traj.response_len):
                logits = model(torch.tensor([ids]))[0, -1] + bias
                nxt = int(logits.argmax())
                expected.append(nxt)
                ids.append(nxt)
                if nxt in stop_token_ids(tokenizer):
                    break
        n = int(traj.response_mask[row].sum())
        assert traj.response_tokens[row, :n].tolist() == expected[:n]


def test_sampling_matches_tempered_softmax_with_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40000
    seeds = torch.arange(n)
    for temperature, top_k in ((1.0, None), (0.7, None), (1.3, 3)):
        tokens, logprobs = sample_next_token(logits.expand(n, -1), temperature=temperature,
                                             top_k=top_k, seeds=seeds, counter=5)
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        # the returned log-prob is always the full tempered distribution's
        torch.testing.assert_close(logprobs, probs.log()[tokens])
        if top_k is not None:
            probs[probs.argsort(descending=True)[top_k:]] = 0
            probs /= probs.sum()
        freq = torch.bincount(tokens, minlength=6).double() / n
        # 5 standard errors of a binomial proportion
        tol = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1e-9
        assert ((freq - probs.double()).abs() <= tol).all(), (temperature, top_k, freq, probs)


def test_samples_depend_only_on_row_seed_and_step():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    seeds = torch.arange(8) * 7919
    full, _ = sample_next_token(logits, temperature=1.0, seeds=seeds, counter=3)
    halves = [sample_next_token(logits[i : i + 4], temperature=1.0, seeds=seeds[i : i + 4],
                                counter=3)[0] for i in (0, 4)]
    assert torch.equal(full, torch.cat(halves))
    other_step, _ = sample_next_token(logits, temperature=1.0, seeds=seeds, counter=4)
    assert not torch.equal(full, other_step)


@pytest.mark.parametrize("vocab", [7, 256, 1000, 128256 // 16])
def test_inverse_cdf_sample_equals_full_cumulative_sum(vocab):
    """The two-level search picks the id of one float64 cumulative sum over the row (apart from
    draws within float32 rounding of a boundary: none among these), never an id of probability
    0 (forbidden ids, the padding of a last partial block)."""
    from torchtune_grpo.rollout.sampling import inverse_cdf_sample

    torch.manual_seed(vocab)
    n = 512
    logits = torch.randn(n, vocab) * 3
    logits[:, torch.rand(vocab) < 0.3] = float("-inf")  # forbidden ids
    logits[:, 0] = 0.0  # at least one allowed id per row
    probs = torch.softmax(logits, -1)
    u = torch.rand(n, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    u[:4] = torch.tensor([1e-12, 1 - 1e-12, 0.5, 1 - 1e-9], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    got = inverse_cdf_sample(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(1, got.unsqueeze(1)) > 0).all()
