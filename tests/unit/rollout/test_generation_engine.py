"""The generation engine: span KV cache, shared prefill, early exit, exactness.

The engine must give the same answers as the plain full forward (greedy = step-by-step argmax,
generation log-probs = the training forward's), independently of how rows are batched, while
allocating its cache once per rollout, prefilling each distinct prompt once and attending over
the filled span only.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from torchtune_grpo.backends import cpu_decode as pd
from torchtune_grpo.policy import kv_cache as kvc
from torchtune_grpo.policy.forward import response_logprobs
from torchtune_grpo.policy.kv_cache import attention_modules
from torchtune_grpo.policy.positions import attention_mask, position_ids
from torchtune_grpo.quickstart.tiny import tiny_llama
from torchtune_grpo.rollout import native as gen
from torchtune_grpo.rollout.native import (
    NativeGenerator,
    generate_micro_batch,
    generate_trajectory,
)
from torchtune_grpo.rollout.protocol import GenerationRequest
from torchtune_grpo.token_rules import allowed_token_mask, logit_bias_from_mask, stop_token_ids

PROMPTS = ["1+2=", "13+27=", "5+5=", "99+1=", "40+2=", "7+70=", "3+33=", "11+1="]


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    tokens = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return tokens, mask


def _prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_bos=True, add_eos=False)
            for i in range(n)]


@pytest.fixture
def setup(tokenizer):
    torch.manual_seed(3)
    model = tiny_llama().eval()
    bias = logit_bias_from_mask(allowed_token_mask(tokenizer, 320))
    stops = torch.tensor(stop_token_ids(tokenizer))
    return model, bias, stops


def _kwargs(tokenizer, bias, stops, **over):
    kw = {"max_generated_tokens": 10, "temperature": 0.0, "top_k": None, "stop_tokens": stops,
          "pad_id": tokenizer.pad_id, "logit_bias": bias}
    kw.update(over)
    return kw


@pytest.mark.parametrize("forward_batch_size", [9, 6, 2])
def test_greedy_equals_stepwise_argmax_with_padding_and_shared_prompts(
    tokenizer, setup, forward_batch_size
):
    model, bias, stops = setup
    prompts = _prompts(tokenizer, 3)  # lengths differ: left padding of different widths
    tokens, mask = _left_pad(prompts, tokenizer.pad_id)
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=3,
        forward_batch_size=forward_batch_size, **_kwargs(tokenizer, bias, stops)))
    for row in range(9):
        ids = list(prompts[row // 3])
        expected = []
        with torch.no_grad():
            for _ in range(traj.response_len):
                nxt = int((model(torch.tensor([ids]))[0, -1] + bias).argmax())
                expected.append(nxt)
                ids.append(nxt)
                if nxt in stop_token_ids(tokenizer):
                    break
        n = int(traj.response_mask[row].sum())
        assert n == min(len(expected), traj.response_len)
        assert traj.response_tokens[row, :n].tolist() == expected[:n]


@pytest.mark.parametrize("top_k", [None, 5])
def test_generation_logprobs_equal_training_forward(tokenizer, setup, top_k):
    model, bias, stops = setup
    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=4,
        forward_batch_size=8, prompt_seeds=torch.arange(4),
        **_kwargs(tokenizer, bias, stops, temperature=0.7, top_k=top_k, max_generated_tokens=16)))
    padding = traj.padding_mask
    logprobs, _ = response_logprobs(
        model, traj.tokens, prompt_len=traj.prompt_len, mask=attention_mask(padding),
        input_pos=position_ids(padding), temperature=0.7, logit_bias=bias,
    )
    m = traj.response_mask
    assert m.sum() > 16
    assert (logprobs[m] - traj.logprobs[m]).abs().max() < 1e-4
    assert (traj.logprobs[~m] == 0).all()


def test_same_seeds_same_outputs_for_any_forward_batch_size(tokenizer, setup):
    _, bias, stops = setup
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False).eval()  # near-uniform: varied samples
    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    kw = _kwargs(tokenizer, bias, stops, temperature=1.0, max_generated_tokens=8)
    runs = [
        generate_trajectory(model, GenerationRequest(tokens, mask, group_size=4,
            forward_batch_size=fbs, prompt_seeds=torch.tensor([11, 22, 33, 44]), **kw))
        for fbs in (16, 4, 1)
    ]
    for other in runs[1:]:
        n = min(runs[0].response_len, other.response_len)
        assert torch.equal(runs[0].response_mask[:, :n], other.response_mask[:, :n])
        assert not runs[0].response_mask[:, n:].any() and not other.response_mask[:, n:].any()
        assert torch.equal(runs[0].response_tokens[:, :n], other.response_tokens[:, :n])
        torch.testing.assert_close(runs[0].logprobs[:, :n], other.logprobs[:, :n],
                                   atol=1e-5, rtol=0)
    # samples of one group differ from each other (the seeds are per sample)
    assert not torch.equal(runs[0].response_tokens[0], runs[0].response_tokens[1])


def test_cache_allocated_once_per_rollout_and_removed_after(tokenizer, setup, monkeypatch):
    model, bias, stops = setup
    allocations = []
    original = gen.KVCacheStorage.__init__

    def counting(self, *args, **kwargs):
        allocations.append(kwargs["rows"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(gen.KVCacheStorage, "__init__", counting)
    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    generate_trajectory(model, GenerationRequest(tokens, mask, group_size=2, forward_batch_size=2,
        **_kwargs(tokenizer, bias, stops)))
    assert allocations == [2]  # four micro-batches, one allocation
    assert not model.caches_are_setup()
    assert all(a.kv_cache is None and not a.cache_enabled for a in attention_modules(model))
    assert all("forward" not in a.__dict__ for a in attention_modules(model))  # own forward back
    # the model still runs a plain forward afterwards
    model(tokens)


def test_group_prefilled_once_and_decode_attends_over_filled_span(tokenizer, setup):
    model, bias, stops = setup
    prompts = _prompts(tokenizer, 2)
    tokens, mask = _left_pad(prompts, tokenizer.pad_id)
    embed_rows, spans = [], []
    h1 = model.tok_embeddings.register_forward_hook(
        lambda _m, inputs, _o: embed_rows.append(tuple(inputs[0].shape)))
    attn = attention_modules(model)[0]
    h2 = attn.register_forward_hook(lambda m, _i, _o: spans.append(m.kv_cache.size))
    try:
        traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=4,
            forward_batch_size=8, **_kwargs(tokenizer, bias, stops, max_generated_tokens=6)))
    finally:
        h1.remove()
        h2.remove()
    p = tokens.shape[1]
    assert embed_rows[0] == (2, p)  # 2 distinct prompts prefilled for 8 rows
    assert all(shape == (8, 1) for shape in embed_rows[1:])
    assert len(embed_rows) == traj.response_len  # no forward after the last sampled token
    assert spans == [p + t for t in range(traj.response_len)]


def test_early_exit_when_every_row_stopped(tokenizer, setup):
    model, _, stops = setup
    only_stop = torch.full((320,), float("-inf"))
    only_stop[tokenizer.eot_id] = 0.0
    calls = []
    hook = model.tok_embeddings.register_forward_hook(lambda *_: calls.append(1))
    tokens, mask = _left_pad(_prompts(tokenizer, 2), tokenizer.pad_id)
    try:
        traj = generate_micro_batch(model, GenerationRequest(tokens, mask, max_generated_tokens=20,
            temperature=1.0, top_k=None, stop_tokens=stops, pad_id=tokenizer.pad_id,
            logit_bias=only_stop),
            seeds=torch.arange(2))
    finally:
        hook.remove()
    assert traj.response_len == 1 and traj.stopped.all()
    assert len(calls) == 1  # the prefill only


def _stop_at_once_other_rank_at_step_5(tokenizer):
    """A logit bias that makes this rank's rows stop at once, and an ``all_done`` that says
    another rank finishes at step 5; returns ``(bias, all_done, votes)``."""
    only_stop = torch.full((320,), float("-inf"))
    only_stop[tokenizer.eot_id] = 0.0
    votes: list[bool] = []

    def all_done(local: bool) -> bool:
        votes.append(local)
        return local and len(votes) >= 5

    return only_stop, all_done, votes


def test_lockstep_keeps_decoding_until_all_ranks_done(tokenizer, setup):
    model, _, stops = setup
    only_stop, all_done, votes = _stop_at_once_other_rank_at_step_5(tokenizer)

    tokens, mask = _left_pad(_prompts(tokenizer, 2), tokenizer.pad_id)
    traj = generate_micro_batch(model, GenerationRequest(tokens, mask, max_generated_tokens=20,
        temperature=0.0, top_k=None, stop_tokens=stops, pad_id=tokenizer.pad_id,
        logit_bias=only_stop, all_done=all_done))
    assert traj.response_len == 5
    assert traj.response_mask[:, 0].all() and not traj.response_mask[:, 1:].any()
    assert (traj.response_tokens[:, 1:] == tokenizer.pad_id).all()


def test_existing_torchtune_caches_are_replaced(tokenizer, setup):
    model, bias, stops = setup
    model.setup_caches(batch_size=1, dtype=torch.float32, decoder_max_seq_len=64)
    tokens, mask = _left_pad(_prompts(tokenizer, 2), tokenizer.pad_id)
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=2,
        forward_batch_size=4, **_kwargs(tokenizer, bias, stops)))
    assert traj.num_sequences == 4
    assert not model.caches_are_setup()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_decode_matches_eager(tokenizer, setup):
    """The engine's compiled step is one graph: over two 64-token rollouts (stop checks every 8
    steps) dynamo compiles it once, with no graph break and no recompile; it decodes the eager
    tokens and log-probs (float32), and writes nothing onto the policy module."""
    from torch._dynamo.utils import counters

    model, bias, stops = setup
    tokens, mask = _left_pad(_prompts(tokenizer, 2), tokenizer.pad_id)
    request = GenerationRequest(tokens, mask, group_size=2, forward_batch_size=4,
                                prompt_seeds=torch.arange(2), stop_check_interval=8,
                                **_kwargs(tokenizer, bias, torch.tensor([-1]), temperature=1.0,
                                          max_generated_tokens=64))
    eager = generate_trajectory(model, request, packed_weights=False)
    assert eager.response_len == 64  # no row stops: every step runs the compiled graph
    engine = NativeGenerator(compile_decode=True)
    attributes = set(vars(model))
    counters.clear()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            compiled = engine.generate(model, request)
            assert torch.equal(eager.tokens, compiled.tokens)
            # inductor's kernels may round differently from eager's on another CPU
            torch.testing.assert_close(eager.logprobs, compiled.logprobs, atol=1e-5, rtol=0)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert set(vars(model)) == attributes


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 1), (4, 4)])
def test_grouped_query_attention_equals_torchtune_forward(num_heads, num_kv_heads):
    """Same output as torchtune's forward (which copies k/v per query head), prefill and decode."""
    torch.manual_seed(0)
    model = tiny_llama(num_heads=num_heads, num_kv_heads=num_kv_heads).eval()
    attn = attention_modules(model)[0]
    b, p, d = 3, 5, 64
    storage = gen.KVCacheStorage(model, rows=b, max_len=p + 2, dtype=torch.float32, device="cpu")
    valid = torch.ones(b, p + 2, dtype=torch.bool)
    valid[0, :2] = False  # a left-padded row
    pos = position_ids(valid)
    x = torch.randn(b, p, d)
    step = torch.randn(b, 1, d)
    outputs = {}
    for name, fn in [("torchtune", lambda *a, **k: type(attn).forward(attn, *a, **k)),
                     ("grouped", lambda *a, **k: kvc.grouped_query_attention(attn, *a, **k))]:
        with torch.no_grad(), kvc.attached(storage, b, None) as caches:
            caches[0].start_prefill(None)
            pre = fn(x, x, mask=attention_mask(valid[:, :p]), input_pos=pos[:, :p])
            dec = fn(step, step, mask=valid[:, None, : p + 1], input_pos=pos[:, p : p + 1])
        outputs[name] = (pre, dec)
    for ours, theirs in zip(outputs["grouped"], outputs["torchtune"]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_attached_installs_grouped_forward_and_restores_an_instance_forward(setup):
    model, _, _ = setup
    attn = attention_modules(model)[0]
    marker = attn.forward  # a bound method set on the instance by someone else
    attn.forward = marker
    storage = gen.KVCacheStorage(model, rows=1, max_len=4, dtype=torch.float32, device="cpu")
    with kvc.attached(storage, 1, None):
        assert attn.__dict__["forward"] is not marker
    assert attn.__dict__["forward"] is marker


# ---------------------------------------------------------------------------- finished rows
def _decode_batch_sizes(model):
    """Record the rows of every model call (``[b, s]`` token ids reach the embedding)."""
    shapes = []
    hook = model.tok_embeddings.register_forward_hook(
        lambda _m, inputs, _o: shapes.append(tuple(inputs[0].shape)))
    return shapes, hook


@pytest.mark.parametrize("forward_batch_size,top_k,stop_bias", [(32, None, 3.0), (8, 20, 1.0)])
def test_dropping_finished_rows_gives_the_same_outputs(tokenizer, setup, forward_batch_size,
                                                       top_k, stop_bias):
    """Shrinking the decode batch changes nothing: tokens, masks, stops and log-probs."""
    _, bias, stops = setup
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False).eval()  # near-uniform: varied samples
    bias = bias.clone()
    bias[tokenizer.eot_id] = stop_bias  # stopping is likely: rows stop at many different steps
    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    kw = _kwargs(tokenizer, bias, stops, temperature=1.0, top_k=top_k, max_generated_tokens=40)
    runs = {}
    for shrink in (False, True):
        shapes, hook = _decode_batch_sizes(model)
        try:
            runs[shrink] = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=8,
                forward_batch_size=forward_batch_size, prompt_seeds=torch.tensor([7, 8, 9, 10]),
                **kw),
                shrink_finished=shrink)
        finally:
            hook.remove()
        runs[shrink, "rows"] = sum(b for b, s in shapes if s == 1)
    old, new = runs[False], runs[True]
    lengths = old.response_mask.sum(1)
    # non-degenerate: rows stop at many different steps, some run to the limit
    assert old.stopped.sum() >= 16 and lengths[old.stopped].unique().numel() >= 8
    assert not old.stopped.all()
    assert old.tokens.shape == new.tokens.shape and old.logprobs.shape == new.logprobs.shape
    assert torch.equal(old.tokens, new.tokens)
    assert torch.equal(old.response_mask, new.response_mask)
    assert torch.equal(old.stopped, new.stopped)
    assert torch.equal(old.prompt_mask, new.prompt_mask)
    # the model's matmuls see a smaller batch, and CPU GEMM kernels round differently for a
    # few rows than for many: log-probs agree to ~2 float32 ulps (measured <= 9.6e-7)
    torch.testing.assert_close(old.logprobs, new.logprobs, atol=1e-6, rtol=1e-6)
    assert (new.logprobs[~new.response_mask] == 0).all()
    assert runs[True, "rows"] < 0.75 * runs[False, "rows"]  # far fewer rows decoded


def test_model_called_on_fewer_rows_after_rows_finish(tokenizer, setup):
    """Decode batch sizes only go down, and by at least a quarter each time they do."""
    model, bias, stops = setup
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=False).eval()
    bias = bias.clone()
    bias[tokenizer.eot_id] = 3.0
    tokens, mask = _left_pad(_prompts(tokenizer, 8), tokenizer.pad_id)
    kw = _kwargs(tokenizer, bias, stops, temperature=1.0, max_generated_tokens=40)
    sizes = {}
    for shrink in (False, True):
        shapes, hook = _decode_batch_sizes(model)
        try:
            traj = generate_micro_batch(model, GenerationRequest(tokens, mask, **kw),
                seeds=torch.arange(8) + 5, shrink_finished=shrink)
        finally:
            hook.remove()
        assert shapes[0] == (8, tokens.shape[1])  # the prefill: every row
        sizes[shrink] = [b for b, _ in shapes[1:]]
        assert len(sizes[shrink]) == traj.response_len - 1  # one forward per decode step
    assert set(sizes[False]) == {8}
    assert sizes[True][0] == 8 and len(sizes[True]) == len(sizes[False])
    assert all(a >= b for a, b in zip(sizes[True], sizes[True][1:]))
    changes = [(a, b) for a, b in zip(sizes[True], sizes[True][1:]) if a != b]
    assert len(changes) >= 2 and all(4 * (a - b) >= a for a, b in changes)
    assert sizes[True][-1] < 8


def test_rank_with_every_row_stopped_keeps_calling_the_model_on_one_row(tokenizer, setup):
    """Lockstep survives shrinking: a finished rank still runs one forward per step."""
    model, _, stops = setup
    only_stop, all_done, votes = _stop_at_once_other_rank_at_step_5(tokenizer)

    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    shapes, hook = _decode_batch_sizes(model)
    try:
        traj = generate_micro_batch(model, GenerationRequest(tokens, mask, max_generated_tokens=20,
            temperature=0.0, top_k=None, stop_tokens=stops, pad_id=tokenizer.pad_id,
            logit_bias=only_stop, all_done=all_done))
    finally:
        hook.remove()
    assert [b for b, _ in shapes] == [4, 1, 1, 1, 1]  # prefill, then 4 steps on one row
    assert traj.response_len == 5 and traj.stopped.all()
    assert traj.response_mask[:, 0].all() and not traj.response_mask[:, 1:].any()
    assert (traj.response_tokens[:, 1:] == tokenizer.pad_id).all()
    assert (traj.logprobs[:, 1:] == 0).all()


def test_rows_to_keep_policy():
    """Shrink once a quarter of the batch stopped; keep one row when every row stopped."""
    t, f = True, False
    assert gen._rows_to_keep(torch.tensor([f, f, f, f])) is None
    assert gen._rows_to_keep(torch.tensor([f, t, f, f, f, f, f, f])) is None  # 1/8
    assert gen._rows_to_keep(torch.tensor([f, t, f, f, f, f, f, t])).tolist() == [0, 2, 3, 4, 5, 6]
    assert gen._rows_to_keep(torch.tensor([t, f])).tolist() == [1]
    assert gen._rows_to_keep(torch.tensor([t, t, t])).tolist() == [0]
    assert gen._rows_to_keep(torch.tensor([t])) is None  # nothing left to drop


# ---------------------------------------------------------------------------- packed weights
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_packed_weights_same_samples_as_plain_linears(tokenizer, setup, tied, monkeypatch):
    """Decoding on oneDNN-reordered weights, with the layers fused or each linear on its own,
    samples the same tokens with the same log-probs (to float rounding) as the layers' own
    F.linear, and really runs on the packed copies (4 products per fused layer, 7 unfused)."""
    _, bias, stops = setup
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=tied).eval()
    if tied:  # a tied head repeats the last token; smaller logits make the samples varied
        model.tok_embeddings.weight.data.mul_(0.1)
    tokens, mask = _left_pad(_prompts(tokenizer, 4), tokenizer.pad_id)
    kw = _kwargs(tokenizer, bias, stops, temperature=1.0, max_generated_tokens=12)
    calls = []
    original, original_add, fusable = pd._onednn_linear, pd._onednn_linear_add, pd._fusable
    monkeypatch.setattr(pd, "_onednn_linear", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(pd, "_onednn_linear_add", lambda *a: calls.append(1) or original_add(*a))
    runs, products = {}, {}
    for name, packed, fuse in [("plain", False, True), ("unfused", True, False),
                               ("fused", True, True)]:
        monkeypatch.setattr(pd, "_fusable", fusable if fuse else lambda *a: False)
        calls.clear()
        runs[name] = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=4,
            forward_batch_size=8, prompt_seeds=torch.tensor([5, 6, 7, 8]), **kw),
            packed_weights=packed)
        products[name] = len(calls)
    decode_steps = runs["plain"].response_len - 1
    assert products["plain"] == 0
    assert products["unfused"] >= (7 * 2 + 1) * decode_steps  # every linear, every decode step
    assert products["fused"] >= (4 * 2 + 1) * decode_steps  # qkv, out, gate|up, down; head
    assert products["fused"] < products["unfused"]
    plain = runs["plain"]
    assert plain.response_mask.sum() > 40
    assert plain.response_tokens[plain.response_mask].unique().numel() >= 10  # varied samples
    for name in ("unfused", "fused"):
        assert torch.equal(plain.response_tokens, runs[name].response_tokens), name
        assert torch.equal(plain.response_mask, runs[name].response_mask), name
        torch.testing.assert_close(plain.logprobs, runs[name].logprobs, atol=1e-5, rtol=0)
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored


@needs_onednn
def test_packed_linear_weights_scope_and_fallbacks(setup, monkeypatch):
    """What gets packed (plain float32 nn.Linear and the tied output projection, not LoRA
    layers, not other dtypes), big inputs keep F.linear bit for bit, and every layer gets its
    own forward back, also when the rollout raises. (Layers not fused here: see below.)"""
    from torchtune.models.llama3_2 import lora_llama3_2

    from torchtune_grpo.backends.cpu_decode import PACKED_MAX_ROWS, packed_linear_weights

    model, _, _ = setup
    attn = model.layers[0].attn
    onednn = []
    original = pd._onednn_linear
    monkeypatch.setattr(pd, "_onednn_linear", lambda *a: onednn.append(1) or original(*a))
    with packed_linear_weights(model) as count:  # fused layers: their linears keep F.linear
        assert count == 7 * len(model.layers) + 1
        assert all("forward" in layer.__dict__ for layer in model.layers)
        assert "forward" not in attn.q_proj.__dict__ and "forward" in model.output.linear.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    monkeypatch.setattr(pd, "_fusable", lambda *a: False)
    with packed_linear_weights(model) as count:
        assert count == 7 * len(model.layers) + 1
        assert "forward" in attn.q_proj.__dict__ and "forward" in model.output.linear.__dict__
        big = torch.randn(PACKED_MAX_ROWS + 1, attn.q_proj.in_features)
        assert torch.equal(attn.q_proj(big), torch.nn.functional.linear(big, attn.q_proj.weight))
        assert not onednn
        small = torch.randn(3, 1, attn.q_proj.in_features)
        torch.testing.assert_close(attn.q_proj(small),
                                   torch.nn.functional.linear(small, attn.q_proj.weight))
        assert len(onednn) == 1
        torch.testing.assert_close(model.output(small), small @ model.tok_embeddings.weight.T)
        assert len(onednn) == 2
    assert "forward" not in attn.q_proj.__dict__ and "forward" not in model.output.linear.__dict__
    with pytest.raises(RuntimeError, match="boom"):
        with packed_linear_weights(model):
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())
    with packed_linear_weights(model, enabled=False) as count:
        assert count == 0
    with packed_linear_weights(tiny_llama().to(torch.bfloat16)) as count:
        assert count == 0
    lora = lora_llama3_2(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=False,
                         vocab_size=320, num_layers=1, num_heads=4, num_kv_heads=2,
                         embed_dim=64, max_seq_len=64, intermediate_dim=128, lora_rank=4,
                         lora_alpha=8)
    monkeypatch.undo()
    with packed_linear_weights(lora) as count:
        # k_proj, output_proj, w1, w2, w3 and the tied output; q_proj and v_proj are LoRA, so
        # the layer is not fused
        assert count == 5 + 1
        assert "forward" not in lora.layers[0].__dict__
        assert "forward" not in lora.layers[0].attn.q_proj.lora_a.__dict__


def tiny_qwen3(tmp_path):
    """Our Qwen3 (per-head q/k RMSNorms before a rotate-half RoPE) from a tiny ``config.json``,
    random weights, q/k norm scales far from 1."""
    import json

    from torchtune_grpo.models import hf_model

    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=True, hidden_act="silu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = hf_model(str(tmp_path)).eval()
    with torch.no_grad():
        for layer in model.layers:
            for proj in (layer.attn.q_proj, layer.attn.k_proj):
                proj.norm.scale.uniform_(0.2, 3.0)
    return model


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qkv_bias", "qwen3"])
def test_fused_decode_layer_equals_the_layer_and_falls_back(kind, tmp_path, monkeypatch):
    """A fused layer's decode step (and short prefill) equals the layer's own forward through
    the span cache (q/k/v biases as Qwen2 has them; Qwen3's per-head q/k norms before a
    rotate-half RoPE); long inputs, autograd and a layer without a span cache run the layer's
    own forward, bit for bit."""
    torch.manual_seed(0)
    model = tiny_qwen3(tmp_path) if kind == "qwen3" else tiny_llama(num_heads=4,
                                                                     num_kv_heads=2).eval()
    layer = model.layers[0]
    if kind == "qkv_bias":
        for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
            proj.bias = torch.nn.Parameter(torch.randn(proj.out_features))
    assert pd._fusable(layer, set())
    fused = pd.fused_decode_layer(layer)
    b, p, d = 3, 5, 64
    valid = torch.ones(b, p + 2, dtype=torch.bool)
    valid[0, :2] = False  # a left-padded row
    pos = position_ids(valid)
    x, step = torch.randn(b, p, d), torch.randn(b, 1, d)
    storage = gen.KVCacheStorage(model, rows=b, max_len=p + 2, dtype=torch.float32, device="cpu")
    outputs = {}
    shortcuts = []  # decode steps that took the one-call attention of attend_decode_step
    step_attention = pd.attend_decode_step

    def spied(*args, **kwargs):
        shortcuts.append(step_attention(*args, **kwargs))
        return shortcuts[-1]

    monkeypatch.setattr(pd, "attend_decode_step", spied)
    for name, fn in [("own", lambda *a, **k: type(layer).forward(layer, *a, **k)),
                     ("fused", fused)]:
        with torch.no_grad(), kvc.attached(storage, b, None) as caches:
            caches[0].start_prefill(None)
            pre = fn(x, mask=attention_mask(valid[:, :p]), input_pos=pos[:, :p])
            dec = fn(step, mask=valid[:, None, : p + 1], input_pos=pos[:, p : p + 1])
        outputs[name] = (pre, dec)
    monkeypatch.undo()
    assert len(shortcuts) == 1 and shortcuts[0] is not None
    assert outputs["own"][1].abs().max() > 0.1
    for ours, theirs in zip(outputs["fused"], outputs["own"]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)

    calls = []
    saved = pd._onednn_linear, pd._onednn_linear_add
    pd._onednn_linear = lambda *a: calls.append(1) or saved[0](*a)
    pd._onednn_linear_add = lambda *a: calls.append(1) or saved[1](*a)
    try:
        big = torch.randn(1, pd.PACKED_MAX_ROWS + 1, d)
        assert torch.equal(fused(big), type(layer).forward(layer, big))  # no cache: own forward
        with kvc.attached(storage, b, None) as caches:  # autograd on: own forward
            caches[0].start_prefill(None)
            pre = fused(x, mask=attention_mask(valid[:, :p]), input_pos=pos[:, :p])
        assert torch.equal(pre, outputs["own"][0])
        assert not calls
        with torch.no_grad(), kvc.attached(storage, b, None) as caches:
            caches[0].start_prefill(None)
            fused(x, mask=attention_mask(valid[:, :p]), input_pos=pos[:, :p])
        assert len(calls) == 4  # qkv, output, gate|up, down
    finally:
        pd._onednn_linear, pd._onednn_linear_add = saved


# ---------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("scaled", [False, True])
def test_rotate_equals_torchtune_rope_and_reuses_the_step_angles(scaled, monkeypatch):
    """The one-kernel rotation equals torchtune's rotary forward (plain and Llama 3 scaled),
    gathers the angles once per ``input_pos`` tensor (all layers of a decode step), and gathers
    again for a new or modified ``input_pos``."""
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.modules import RotaryPositionalEmbeddings

    rope = (Llama3ScaledRoPE(16, 64, 10000) if scaled
            else RotaryPositionalEmbeddings(16, 64, 10000))
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, 16)
    pos = torch.tensor([[5, 6], [0, 1], [40, 41]])
    torch.testing.assert_close(kvc.rotate(rope, x, pos), rope(x, input_pos=pos),
                               atol=1e-6, rtol=0)
    angles = rope.__dict__["_grpo_angles"][2]
    y = torch.randn(3, 2, 2, 16)  # another layer (fewer heads), same step
    torch.testing.assert_close(kvc.rotate(rope, y, pos), rope(y, input_pos=pos),
                               atol=1e-6, rtol=0)
    assert rope.__dict__["_grpo_angles"][2] is angles
    pos.add_(1)  # modified in place: gathered again
    torch.testing.assert_close(kvc.rotate(rope, x, pos), rope(x, input_pos=pos),
                               atol=1e-6, rtol=0)
    assert rope.__dict__["_grpo_angles"][2] is not angles
    # no positions: the module's own forward
    torch.testing.assert_close(kvc.rotate(rope, x, None), rope(x), atol=0, rtol=0)
