"""Float32 logits from a bf16 output projection
(:func:`~torchtune_grpo.policy.logprobs.float_matmul`,
:func:`~torchtune_grpo.policy.logprobs.float_logits`), in the engine's head and the trainer's
log-probs alike, and float32 models bitwise unchanged.

The references are float64 products of the same bf16 numbers; the logits are scaled to the
range where bf16 rounding costs log-prob errors of several 1e-2 (``|logit|`` 16-32, spacing
0.125), and each test checks that the old rounding would fail it. Tolerances allow for any
float32 accumulation order (AVX2 or AVX512 kernels). The CUDA branch (``out_dtype``) is checked
for its signature on the meta device only: no GPU here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtune_grpo.policy import logprobs as lp
from torchtune_grpo.policy.head import LAST_POSITION, ResponseLogProbs
from torchtune_grpo.policy.logprobs import chunked_token_logprobs, float_logits, float_matmul
from torchtune_grpo.quickstart.tiny import tiny_llama

V, D = 320, 64


def _inputs(m: int = 24, seed: int = 0):
    """bf16 ``h [m, D]`` and ``W [V, D]`` whose products reach ``|z|`` ~ 30."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * 1.2).bfloat16()
    return h, w


def _exact(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return h.double() @ w.double().t()


def _old_rounding(a, b, out=None):
    """The projection before this change: the product rounded to the inputs' dtype."""
    z = torch.mm(a, b.t()).float()
    return z if out is None else out.copy_(z)


def test_float_matmul_is_the_float32_product_of_bf16_inputs(monkeypatch):
    h, w = _inputs()
    exact = _exact(h, w)
    assert exact.abs().max() > 16
    assert (_old_rounding(h, w).double() - exact).abs().max() > 0.03  # bf16 output rounding
    monkeypatch.setattr(lp, "UPCAST_BLOCK_ELEMENTS", 7 * D)  # 46 blocks, the last one short
    out = torch.full((h.shape[0], V + 5), float("nan"))
    z = float_matmul(h, w, out=out[:, 2 : 2 + V])  # a column slice, as the fused chunks write
    assert z.dtype == torch.float32 and z.data_ptr() == out[:, 2:].data_ptr()
    assert torch.isnan(out[:, :2]).all() and torch.isnan(out[:, 2 + V :]).all()
    torch.testing.assert_close(z.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())
    h32, w32 = h.float(), w.float()  # float32: exactly torch.mm
    assert torch.equal(float_matmul(h32, w32), torch.mm(h32, w32.t()))
    meta = torch.empty(4, D, dtype=torch.bfloat16, device="meta")
    out_meta = torch.empty(4, V, device="meta")  # the CUDA call: out_dtype into a float32 out
    torch.mm(meta, w.to("meta").t(), out_dtype=torch.float32, out=out_meta)


@pytest.mark.parametrize("tied", [True, False])
def test_head_logits_are_the_float32_product(tied):
    """The engine's ``LAST_POSITION`` logits and the plain logits of a bf16 model."""
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=tied).bfloat16().eval()
    head = model.head
    weight = head.output.tied_module.weight if tied else head.output.weight
    with torch.no_grad():
        weight.copy_(_inputs()[1])
        h = torch.randn(3, 5, D).bfloat16()
        exact = _exact(head.norm(h).reshape(15, D), weight).view(3, 5, V)
        assert exact.abs().max() > 16
        for got, ref in ((head(h), exact), (head(h, LAST_POSITION), exact[:, -1:])):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), ref, rtol=0,
                                       atol=1e-5 * exact.abs().max().item())
        assert (head.output(head.norm(h)).double() - exact).abs().max() > 0.03  # the old path


@pytest.mark.parametrize("path", ["fused", "checkpointed", "entropy_grad", "plain", "soft_cap"])
def test_trainer_logprobs_are_the_float32_log_softmax(path):
    """Every log-prob path of a bf16 linear head: values from float32 logits, gradients in the
    inputs' dtypes and equal to the fused path's."""
    h, w = _inputs(m=30, seed=1)
    targets = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(2))
    hidden = h.view(3, 10, D).requires_grad_(True)
    head = nn.Linear(D, V, bias=False).bfloat16()
    head.weight.data.copy_(w)
    exact = _exact(h, w)
    kw = dict(chunk_size=4)
    if path == "checkpointed":
        kw["fused"] = False
    elif path == "entropy_grad":
        kw.update(return_entropy=True, entropy_grad=True)
    elif path == "plain":
        kw["checkpoint"] = False
    project = head
    if path == "soft_cap":
        from torchtune_grpo.policy.head import SoftCappedProjection

        project = SoftCappedProjection(head, 40.0)
        exact = 40.0 * torch.tanh(exact / 40.0)
    logp, ent = chunked_token_logprobs(hidden, project, targets, **kw)
    ref = torch.log_softmax(exact, -1).gather(1, targets.view(-1, 1)).view(3, 10)
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=2e-5)
    (logp.sum() + (ent.sum() if ent is not None else 0)).backward()
    assert hidden.grad.dtype == torch.bfloat16 and head.weight.grad.dtype == torch.bfloat16
    if path in ("checkpointed", "plain"):
        fused_h = h.view(3, 10, D).clone().requires_grad_(True)
        fused_head = nn.Linear(D, V, bias=False).bfloat16()
        fused_head.weight.data.copy_(w)
        chunked_token_logprobs(fused_h, fused_head, targets, chunk_size=4)[0].sum().backward()
        for got, want in ((hidden.grad, fused_h.grad), (head.weight.grad, fused_head.weight.grad)):
            # the two paths round float32 logit gradients to bf16 from different float32 sums
            torch.testing.assert_close(got, want, rtol=0, atol=2**-7 * want.abs().max().item())


def test_float32_models_are_bitwise_unchanged():
    """float32: :func:`float_logits` is the projection's own output, and the head's logits and
    log-probs are those of ``output(norm(h))``."""
    torch.manual_seed(0)
    model = tiny_llama().eval()
    head = model.head
    h = torch.randn(2, 6, D)
    targets = torch.randint(0, V, (2, 5))
    with torch.no_grad():
        direct = head.output(head.norm(h))
        assert torch.equal(float_logits(head.output, head.norm(h)), direct)
        assert torch.equal(head(h), direct)
        assert torch.equal(head(h, LAST_POSITION), head.output(head.norm(h[:, -1:])))
        logp, _ = head(h, ResponseLogProbs(targets=targets, start=0, chunk_size=4))
        rows = []
        for s in range(0, 10, 4):  # the fused path's chunks: torch.mm, then log-softmax
            z = torch.mm(head.norm(h)[:, :5].reshape(10, D)[s : s + 4],
                         head.output.tied_module.weight.t())
            rows.append(torch._log_softmax(z, 1, False).gather(1, targets.view(-1, 1)[s : s + 4]))
        assert torch.equal(logp, torch.cat(rows).view(2, 5))


def test_lora_output_keeps_its_own_projection():
    """A projection that is not a plain linear (LoRA/DoRA, a biased linear) is called as is:
    its logits are its own output (rounded to the model's dtype), cast to float32."""
    biased = nn.Linear(D, V).bfloat16()
    h = torch.randn(3, D).bfloat16()
    with torch.no_grad():
        assert torch.equal(float_logits(biased, h), biased(h).float())


def test_engine_and_trainer_differ_only_by_their_hidden_states(monkeypatch):
    """The engine (``LAST_POSITION`` logits, one position at a time) and the trainer
    (``ResponseLogProbs``, chunked) see bf16 hidden states that differ in their last bits (a
    KV-cache decode and a full forward round differently). Each side's log-prob is now the
    float32 log-softmax of its own states' exact product, so their gap is exactly the gap those
    states imply. With logits rounded to bf16 (before) each side adds its own rounding, up to
    half a spacing per logit (0.0625 at 16-32) on top of that."""
    torch.manual_seed(0)
    model = tiny_llama().bfloat16().eval()
    head = model.head
    weight = head.output.tied_module.weight
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        weight.mul_(1.5)
        h = torch.randn(16, 65, D, generator=g).bfloat16()
        # engine's states: one element in 64 one bf16 step away (last mantissa bit flipped)
        bits = h.view(torch.int16)
        flip = torch.rand(h.shape, generator=g) < 1 / 64
        h_engine = torch.where(flip, bits ^ 1, bits).view(torch.bfloat16)
        targets = torch.randint(0, V, (16, 64), generator=g)

        def exact(states):  # float64 log-probs of the exact logits of bf16 states
            z = _exact(head.norm(states[:, :64]).reshape(-1, D), weight).view(16, 64, V)
            assert z.abs().max() > 16
            return torch.log_softmax(z, -1).gather(2, targets[..., None])[..., 0]

        implied = exact(h_engine) - exact(h)

        def excess() -> float:  # the engine-trainer gap beyond the one the states imply
            trainer, _ = head(h, ResponseLogProbs(targets=targets, start=0, chunk_size=96))
            engine = torch.stack([torch.log_softmax(head(h_engine[:, t : t + 1], LAST_POSITION),
                                                    -1)[:, 0].gather(1, targets[:, t : t + 1])[:, 0]
                                  for t in range(64)], 1)
            return float(((engine - trainer).double() - implied).abs().max())

        after = excess()
        monkeypatch.setattr(lp, "float_matmul", _old_rounding)
        before = excess()
    assert implied.abs().max() > 1e-3  # the states do differ
    assert after < 5e-5 and before > 0.03, (after, before)
