"""The policy's output head (:mod:`torchtune_grpo.policy.head`) and the decoder that passes it
its request (:mod:`torchtune_grpo.policy.decoder`).

The final-logit soft-cap is checked against ``cap * tanh(logits / cap)`` computed directly from
torchtune's own logits, for every kind of request: plain logits, last-position logits, response
log-probs (and entropy) and packed log-probs. Breaking the head once (skipping the soft-cap in
``OutputHead.logits``) fails ``test_soft_cap_matches_direct_computation[plain]`` and ``[last]``;
skipping it in the projection the log-probs use fails ``[response]`` and ``[packed]``.
"""

from __future__ import annotations

import pytest
import torch
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import TransformerDecoder

from torchtune_grpo.policy.decoder import PolicyDecoder, policy_decoder
from torchtune_grpo.policy.forward import (
    last_logits,
    micro_batch_logprobs,
    response_logprobs,
)
from torchtune_grpo.policy.head import OutputHead
from torchtune_grpo.policy.positions import attention_mask, position_ids
from torchtune_grpo.quickstart.tiny import TINY_MODEL_DIMS, tiny_llama

CAP = 0.75  # well inside the tiny model's logit range: the soft-cap changes every logit


def _models(tied: bool):
    """A torchtune decoder and a soft-capped policy with the same weights."""
    torch.manual_seed(0)
    plain = llama3_2(**{**TINY_MODEL_DIMS, "tie_word_embeddings": tied}).eval()
    capped = policy_decoder(llama3_2(**{**TINY_MODEL_DIMS, "tie_word_embeddings": tied}),
                            final_logit_softcap=CAP).eval()
    capped.load_state_dict(plain.state_dict())
    return plain, capped


def _batch():
    """Left-padded prompts and right-padded responses: ``[3, 5 + 4]``."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 260, (3, 9), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]).bool()
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]).bool()
    return tokens, prompt_mask, response_mask


def _expected_logprobs(logits, tokens, prompt_len, temperature, bias):
    """Log-probs and entropies of the response tokens from full ``[n, P + T, V]`` logits."""
    z = logits[:, prompt_len - 1 : -1] / temperature + bias
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, tokens[:, prompt_len:, None])[..., 0]
    entropy = -(logp_all.exp() * logp_all.clamp(min=-1e30)).sum(-1)  # 0 * -inf: forbidden ids
    return logp, entropy


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("kind", ["plain", "last", "response", "packed"])
def test_soft_cap_matches_direct_computation(kind, tied):
    plain, capped = _models(tied)
    tokens, p_mask, r_mask = _batch()
    padding = torch.cat([p_mask, r_mask], dim=1)
    kw = dict(mask=attention_mask(padding), input_pos=position_ids(padding))
    temperature = 0.7
    bias = torch.zeros(TINY_MODEL_DIMS["vocab_size"])
    bias[300:] = float("-inf")  # ids past the tokenizer's
    with torch.no_grad():
        reference = plain(tokens, **kw).float()  # torchtune's own logits
        direct = CAP * torch.tanh(reference / CAP)
        assert (direct - reference).abs().max() > 0.1  # the cap matters at this scale
        if kind == "plain":
            torch.testing.assert_close(capped(tokens, **kw), direct)
            return
        if kind == "last":
            torch.testing.assert_close(last_logits(capped, tokens, **kw), direct[:, -1:])
            return
        expected, expected_entropy = _expected_logprobs(direct, tokens, 5, temperature, bias)
        args = dict(temperature=temperature, logit_bias=bias, return_entropy=True)
        if kind == "response":
            logp, entropy = response_logprobs(capped, tokens, prompt_len=5, **kw, **args)
        else:
            logp, entropy = micro_batch_logprobs(capped, tokens, p_mask, r_mask, pack=True,
                                                 **args)
            expected = expected * r_mask
            expected_entropy = expected_entropy * r_mask
    torch.testing.assert_close(logp, expected)
    torch.testing.assert_close(entropy, expected_entropy)


def test_soft_capped_logprobs_have_gradients():
    """The soft-capped projection runs through the checkpointed chunks: gradients reach the
    output weights and the layers below."""
    _, capped = _models(tied=False)
    capped.train()
    tokens, p_mask, r_mask = _batch()
    logp, _ = micro_batch_logprobs(capped, tokens, p_mask, r_mask, pack=True)
    logp.sum().backward()
    assert capped.output.weight.grad.abs().sum() > 0
    assert capped.layers[0].attn.q_proj.weight.grad.abs().sum() > 0


def test_no_cap_is_torchtunes_unembed_bitwise():
    """Without a soft-cap the policy's logits are torchtune's, to the bit; the last position alone
    projects a ``[B, D]`` slice, whose GEMM may block differently from the full ``[B*L, D]`` one
    (AVX-512 machines round it differently), so it is held to float rounding."""
    torch.manual_seed(0)
    plain = llama3_2(**TINY_MODEL_DIMS).eval()
    policy = tiny_llama().eval()
    policy.load_state_dict(plain.state_dict())
    tokens, p_mask, r_mask = _batch()
    padding = torch.cat([p_mask, r_mask], dim=1)
    kw = dict(mask=attention_mask(padding), input_pos=position_ids(padding))
    with torch.no_grad():
        reference = plain(tokens, **kw)
        assert torch.equal(policy(tokens, **kw), reference)
        torch.testing.assert_close(last_logits(policy, tokens, **kw), reference[:, -1:],
                                   rtol=1e-6, atol=1e-5)


def test_conversion_keeps_the_decoder_its_names_and_hooks():
    torch.manual_seed(0)
    decoder = llama3_2(**TINY_MODEL_DIMS)
    keys = list(decoder.state_dict())
    calls = []
    decoder.register_forward_hook(lambda *_: calls.append(1))
    policy = policy_decoder(decoder)
    assert policy is decoder and isinstance(policy, PolicyDecoder)
    assert list(policy.state_dict()) == keys
    assert isinstance(policy.head, OutputHead) and policy.head.final_logit_softcap is None
    assert policy.head.norm is policy.norm and policy.head.output is policy.output
    assert policy_decoder(policy) is policy  # a policy stays as it is
    policy(torch.zeros(1, 3, dtype=torch.long))
    assert calls == [1]


def test_conversion_refusals():
    policy = tiny_llama()
    with pytest.raises(ValueError, match="final_logit_softcap"):
        policy_decoder(policy, final_logit_softcap=30.0)

    class Other(TransformerDecoder):
        pass

    torch.manual_seed(0)
    plain = llama3_2(**TINY_MODEL_DIMS)
    other = Other(tok_embeddings=plain.tok_embeddings, layers=plain.layers,
                  max_seq_len=plain.max_seq_len, num_heads=plain.num_heads,
                  head_dim=plain.head_dim, norm=plain.norm, output=plain.output)
    with pytest.raises(TypeError, match="TransformerDecoder"):
        policy_decoder(other)
    with pytest.raises(ValueError, match="> 0"):
        policy_decoder(plain, final_logit_softcap=0.0)


def test_a_plain_decoder_is_told_to_become_a_policy():
    torch.manual_seed(0)
    plain = llama3_2(**TINY_MODEL_DIMS)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="policy_decoder"):
        last_logits(plain, tokens, mask=None, input_pos=torch.arange(3)[None])


def test_only_a_packed_row_may_exceed_max_seq_len():
    torch.manual_seed(0)
    policy = tiny_llama(max_seq_len=9).eval()
    tokens, p_mask, r_mask = _batch()  # rows of 9 tokens (8 run), 21 tokens packed
    with torch.no_grad():
        policy.max_seq_len = 7
        with pytest.raises(ValueError, match="max_seq_len"):
            micro_batch_logprobs(policy, tokens, p_mask, r_mask)  # padded rows of 8 > 7
        policy.max_seq_len = 9
        padded, _ = micro_batch_logprobs(policy, tokens, p_mask, r_mask)
        packed, _ = micro_batch_logprobs(policy, tokens, p_mask, r_mask, pack=True)
    torch.testing.assert_close(packed, padded * r_mask)


def test_a_policy_built_from_parts_equals_a_converted_one():
    plain, capped = _models(tied=True)
    built = PolicyDecoder(tok_embeddings=plain.tok_embeddings, layers=plain.layers,
                          max_seq_len=plain.max_seq_len, num_heads=plain.num_heads,
                          head_dim=plain.head_dim, norm=plain.norm, output=plain.output,
                          final_logit_softcap=CAP).eval()
    tokens = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(2))
    assert list(built.state_dict()) == list(capped.state_dict())
    with torch.no_grad():
        assert torch.equal(built(tokens), capped(tokens))
