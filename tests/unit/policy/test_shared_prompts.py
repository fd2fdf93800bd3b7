"""Prompt-sharing packed forward (``share_prompts``): the members of a group run their prompt
once, and every log-prob, loss and gradient is the one of the unshared packed forward."""

from __future__ import annotations

import pytest
import torch

from torchtune_grpo.algorithm.loss import GRPOLoss
from torchtune_grpo.algorithm.trajectory import prompt_mask
from torchtune_grpo.policy.forward import (
    micro_batch_logprobs,
    packed_micro_batch_logprobs,
)
from torchtune_grpo.policy.packing import SharedPrefixSegments
from torchtune_grpo.quickstart.tiny import tiny_llama

PAD, P, T = 0, 16, 20
GROUPS, G = 3, 4  # 12 rows: 3 prompts, 4 responses each


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _grouped(seed: int = 0):
    """``(tokens [12, P + T], prompt_mask, response_mask)``: 3 prompts of different lengths,
    each repeated for 4 rows with responses of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = [5] * G + [11] * G + [8] * G
    response_lengths = [3, 9, 1, 14, 7, 20, 2, 5, 11, 6, 4, 13]
    n = len(prompt_lengths)
    p_mask = prompt_mask(torch.zeros(n, P, dtype=torch.long), torch.tensor(prompt_lengths))
    r_mask = torch.arange(T)[None, :] < torch.tensor(response_lengths)[:, None]
    tokens = torch.randint(1, 300, (n, P + T), generator=gen)
    for g in range(GROUPS):  # the group's rows share one prompt
        tokens[g * G:(g + 1) * G, :P] = tokens[g * G, :P]
    tokens = torch.where(torch.cat([p_mask, r_mask], dim=1), tokens, PAD)
    return tokens, p_mask, r_mask


def _update(model, share: bool, order, tool_mask=None, mb: int = 6):
    tokens, p_mask, r_mask = _grouped()
    scored = r_mask if tool_mask is None else r_mask & ~tool_mask
    n = tokens.shape[0]
    gen = torch.Generator().manual_seed(2)
    old = torch.randn(n, T, generator=gen) * 0.1 - 5.0
    advantages = torch.randn(n, generator=gen)
    loss_fn = GRPOLoss(aggregation="token_mean", entropy_coeff=0.01)
    normalizer = loss_fn.normalizer_contribution(scored).float()
    model.zero_grad(set_to_none=True)
    logprobs_all, total = torch.zeros(n, T), 0.0
    for i in range(0, n, mb):
        idx = order[i:i + mb]
        logprobs, entropy = micro_batch_logprobs(
            model, tokens[idx], p_mask[idx], scored[idx], pack=True, share_prompts=share,
            tool_mask=None if tool_mask is None else tool_mask[idx], temperature=0.7,
            chunk_size=7, return_entropy=True)
        loss, _ = loss_fn(logprobs, old[idx], advantages[idx], scored[idx],
                          normalizer=normalizer, entropy=entropy)
        loss.backward()
        total += float(loss.detach())
        logprobs_all[idx] = logprobs.detach()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return logprobs_all, total, grads, scored


@pytest.mark.parametrize("order", ["grouped", "shuffled"])
@pytest.mark.parametrize("tools", [False, True])
def test_shared_prompt_update_equals_unshared(order, tools):
    torch.manual_seed(0)
    model = tiny_llama()
    perm = (torch.arange(12) if order == "grouped"
            else torch.randperm(12, generator=torch.Generator().manual_seed(3)))
    tool = None
    if tools:
        _, _, r_mask = _grouped()
        tool = torch.zeros_like(r_mask)
        tool[1, 2:5] = tool[5, 10:14] = tool[11, 3:6] = True
        assert (tool & r_mask).sum() == tool.sum()
    lp_s, loss_s, grads_s, scored = _update(model, True, perm, tool)
    lp_u, loss_u, grads_u, _ = _update(model, False, perm, tool)
    assert (lp_s[~scored] == 0).all() and (lp_s[scored] < 0).float().mean() > 0.9
    torch.testing.assert_close(lp_s[scored], lp_u[scored], rtol=1e-5, atol=1e-5)
    assert loss_u != 0 and abs(loss_s - loss_u) <= 1e-5 * abs(loss_u) + 1e-7
    for name, ref in grads_u.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads_s[name], ref, rtol=1e-5,
                                   atol=1e-5 * ref.abs().max().item(), msg=name)


class _PackSpy(torch.nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder, self.calls = decoder, []

    def forward(self, tokens, *, mask, input_pos, output=None):
        self.calls.append((tokens.clone(), input_pos.clone(), mask))
        return self.decoder(tokens, mask=mask, input_pos=input_pos, output=output)


def test_each_prompt_runs_once_at_its_own_positions():
    torch.manual_seed(0)
    spy = _PackSpy(tiny_llama())
    tokens, p_mask, r_mask = _grouped()
    rows = torch.tensor([0, 5, 1, 6, 9])  # two rows of group 0, two of group 1, one of group 2
    with torch.no_grad():
        packed_micro_batch_logprobs(spy, tokens[rows], p_mask[rows], r_mask[rows],
                                    share_prompts=True)
    ((seen, pos, mask),) = spy.calls
    assert mask == SharedPrefixSegments(((5, (3, 9)), (11, (20, 2)), (8, (6,))))
    assert seen.shape[1] == 5 + 11 + 8 + 3 + 9 + 20 + 2 + 6  # the prompts once, not 5 times
    expected_pos = torch.cat([torch.arange(5), 5 + torch.arange(3), 5 + torch.arange(9),
                              torch.arange(11), 11 + torch.arange(20), 11 + torch.arange(2),
                              torch.arange(8), 8 + torch.arange(6)])
    assert torch.equal(pos[0], expected_pos)
    assert torch.equal(seen[0, :5], tokens[0, P - 5:P])
    assert torch.equal(seen[0, 5:8], tokens[0, P:P + 3])


def test_suffixes_do_not_see_each_other():
    """A row's log-probs do not change when another response of its group changes."""
    torch.manual_seed(0)
    model = tiny_llama()
    tokens, p_mask, r_mask = _grouped()
    with torch.no_grad():
        a, _ = packed_micro_batch_logprobs(model, tokens[:4], p_mask[:4], r_mask[:4],
                                           share_prompts=True)
        other = tokens.clone()
        other[0, P:P + 3] = (other[0, P:P + 3] + 5) % 300 + 1
        b, _ = packed_micro_batch_logprobs(model, other[:4], p_mask[:4], r_mask[:4],
                                           share_prompts=True)
    assert not torch.allclose(a[0], b[0])
    torch.testing.assert_close(a[1:], b[1:], rtol=1e-6, atol=1e-6)
