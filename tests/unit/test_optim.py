"""``torchtune_grpo.optim``: the bf16 AdamW (float32 equal to ``torch.optim.AdamW`` to the bit,
unbiased stochastic rounding, updates in slices) and the one line for an optimizer whose
compiled step fails (a real inductor failure: a C++ compiler that does not exist).

The 2-rank FSDP2 runs of the optimizers through the recipe are in
``tests/recipes/test_optimizer.py`` (slow).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from torchtune_grpo import distributed as D
from torchtune_grpo import optim
from torchtune_grpo.errors import reported_as_one_line
from torchtune_grpo.training.update import PolicyUpdate, UpdateSettings


def _pair(shapes, dtype=torch.float32, seed=0):
    """Two identical lists of parameters."""
    gen = torch.Generator().manual_seed(seed)
    a = [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    return a, [nn.Parameter(p.detach().clone()) for p in a]


def _steps(pairs, optimizers, n, seed=1):
    """``n`` steps of every optimizer, each pair of parameters given the same gradient."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for params in zip(*pairs):
            g = torch.randn(params[0].shape, generator=gen).to(params[0].dtype)
            for p in params:
                p.grad = g.clone()
        for o in optimizers:
            o.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_float32_update_is_torch_adamw_to_the_bit(weight_decay, monkeypatch):
    """fp32 weights: the same arithmetic as ``torch.optim.AdamW`` in the same order, so the
    weights and both moments are bitwise equal after 5 steps; also when the parameter is
    updated in slices (``CHUNK`` made small)."""
    monkeypatch.setattr(optim, "CHUNK", 100)  # the 33 x 17 parameter goes in 6 slices
    ours, theirs = _pair([(33, 17), (7,)])
    start = [p.detach().clone() for p in ours]
    a = optim.AdamW(ours, lr=1e-2, weight_decay=weight_decay, betas=(0.8, 0.99))
    b = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=weight_decay, betas=(0.8, 0.99),
                          foreach=False)
    _steps((ours, theirs), (a, b), 5)
    for p, q, before in zip(ours, theirs, start):
        assert not torch.equal(p, before)
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.state[p][key], b.state[q][key]), key


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    """Each result is one of the two bf16 values around ``x``, and the mean over many draws is
    ``x`` (round-to-nearest would give the lower neighbour every time here)."""
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.tensor(1.0 + 2**-7, dtype=torch.bfloat16)  # the next bf16 value after 1.0
    x = torch.full((200_000,), 1.0 + 0.3 * 2**-7)  # 30% of the way from lo to hi
    torch.manual_seed(0)
    rounded = optim.stochastic_round_bf16(x)
    assert rounded.dtype == torch.bfloat16
    assert bool(((rounded == lo) | (rounded == hi)).all())
    assert (rounded == hi).float().mean().item() == pytest.approx(0.3, abs=0.005)
    assert rounded.double().mean().item() == pytest.approx(x[0].item(), abs=1e-5)
    assert torch.equal(x.bfloat16(), torch.full_like(rounded, 1.0))  # nearest: always lo
    exact = torch.tensor([0.5, -3.0, 0.0, float("inf")])  # bf16 values stay as they are
    assert torch.equal(optim.stochastic_round_bf16(exact), exact.bfloat16())


def test_bf16_small_updates_land_on_average():
    """bf16 weights at lr 1e-4 (a step of ~1/80 of bf16's spacing at 1.0): torch's AdamW
    leaves them at 1.0, this one moves them by ~lr a step on average; with
    ``bf16_stochastic_round=False`` it rounds them away as torch does."""
    torch.manual_seed(0)
    lr, n = 1e-4, 20
    params = [nn.Parameter(torch.ones(8192, dtype=torch.bfloat16)) for _ in range(3)]
    opts = [optim.AdamW(params[:1], lr=lr, weight_decay=0.0),
            torch.optim.AdamW(params[1:2], lr=lr, weight_decay=0.0),
            optim.AdamW(params[2:], lr=lr, weight_decay=0.0, bf16_stochastic_round=False)]
    for _ in range(n):
        for p in params:
            p.grad = torch.ones_like(p)
        for o in opts:
            o.step()
    assert (1 - params[0].float()).mean().item() == pytest.approx(n * lr, rel=0.1)
    assert torch.equal(params[1], torch.ones_like(params[1]))
    assert torch.equal(params[2], torch.ones_like(params[2]))


def test_rounding_resumes_exactly_and_ignores_the_global_generator():
    """The draws are a function of the state: 3 steps in one go, and 2 steps + a state dict
    loaded into a new optimizer + 1 step with the global generator moved in between, give
    bitwise the same bf16 weights; another ``seed`` gives others."""
    def run(split: bool, seed: int = 0):
        params = [nn.Parameter(torch.full((4096,), 0.3, dtype=torch.bfloat16))]
        opt = optim.AdamW(params, lr=1e-4, weight_decay=0.0, seed=seed)
        for step in range(3):
            if split and step == 2:
                state = opt.state_dict()
                torch.manual_seed(step + 123)
                torch.rand(7)
                opt = optim.AdamW(params, lr=1e-4, weight_decay=0.0, seed=seed)
                opt.load_state_dict(state)
            params[0].grad = torch.linspace(-1, 1, 4096, dtype=torch.bfloat16)
            opt.step()
        return params[0].detach().clone()

    torch.manual_seed(0)
    whole = run(split=False)
    assert not torch.equal(whole, torch.full_like(whole, 0.3))
    assert torch.equal(run(split=True), whole)
    assert not torch.equal(run(split=False, seed=1), whole)


def test_arguments_are_checked():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas must be in"):
        optim.AdamW(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="must be >= 0"):
        optim.AdamW(p, lr=-1.0)


# ---------------------------------------------------------------------------- compile errors
def _update(optimizer, model) -> PolicyUpdate:
    """A :class:`PolicyUpdate` around ``model`` and ``optimizer`` (only its optimizer step is
    used)."""
    settings = UpdateSettings(
        ppo_epochs=1, forward_batch_size=1, group_size=1, seed=0, temperature=1.0,
        packed=False, share_prompt_forward=False, clip_grad_norm=1.0,
        skip_zero_advantage_sequences=False, gather_weights=False, chunk_size=16, keep_probs=0)
    return PolicyUpdate(model, optimizer, None, nn.Identity(), D.Ranks(D.LOCAL),
                        torch.device("cpu"), settings, logit_bias=torch.zeros(1), ref_model=None,
                        is_lora=False, activation_offloading=contextlib.nullcontext())


def test_a_failing_compile_is_one_line_naming_the_key(monkeypatch, capsys):
    """torchao's ``_AdamW`` compiles its step; with no working C++ compiler (inductor pointed at
    one that does not exist, its caches off so it must compile) the first optimizer step of the
    update raises one line that names the reason and ``optimizer._component_``; the entry
    point's handler prints just that line and exits 2."""
    torchao_optim = pytest.importorskip("torchao.optim")
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    torch._dynamo.reset()
    model = nn.Linear(5, 3)
    update = _update(torchao_optim._AdamW(model.parameters(), lr=1e-3,
                                          bf16_stochastic_round=True), model)
    model(torch.randn(2, 5)).sum().backward()
    try:
        with pytest.raises(optim.OptimizerCompileError) as info:
            update.optimizer_step(step=0)
    finally:
        torch._dynamo.reset()
    line = str(info.value)
    assert "\n" not in line and len(line) < 800, line
    assert line.startswith("the optimizer torchao.optim.adam._AdamW failed to compile its step")
    assert "InvalidCxxCompiler: No working C++ compiler found" in line
    assert "set optimizer._component_=torchtune_grpo.optim.AdamW" in line
    assert ("optimizer._component_=torch.optim.AdamW and remove "
            "optimizer.bf16_stochastic_round") in line
    with pytest.raises(SystemExit) as exit_info, reported_as_one_line():
        raise info.value
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {line}"]


def test_the_line_names_the_op_that_failed_under_fsdp2():
    """torchao's ``_AdamW`` with ``bf16_stochastic_round`` on FSDP2 shards fails while dynamo
    traces it, with the op's own error buried in a long explanation (text of the 2-rank run):
    the line keeps that error and leaves the tensor listings out."""
    from torch._dynamo.exc import TorchRuntimeError

    text = ("RuntimeError when making fake tensor call\n  Explanation: Dynamo failed to run FX "
            "node with fake tensors: call_function <built-in function lt>(*(FakeTensor(..., "
            "size=(320, 64), dtype=torch.int32), DTensor(local_tensor=FakeTensor(...))), **{}): "
            "got RuntimeError('aten.lt.Tensor got mixed torch.Tensor and DTensor, need to "
            "convert all torch.Tensor to DTensor before calling distributed operators!')\n"
            "  Hint: Your code may result in an error when running in eager.")
    line = optim.compile_failure_line(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
                                      TorchRuntimeError(text))
    assert ("failed to compile its step with torch.compile (TorchRuntimeError: RuntimeError: "
            "aten.lt.Tensor got mixed torch.Tensor and DTensor, need to convert all "
            "torch.Tensor to DTensor before calling distributed operators!); set "
            "optimizer._component_=torchtune_grpo.optim.AdamW") in line
    assert line.endswith("or optimizer._component_=torch.optim.AdamW")  # SGD: nothing to drop


def test_other_optimizer_errors_pass_unchanged():
    """Only compile errors are rewritten: a plain error of a step keeps its type and text."""

    class Broken(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("not a compile error")

    model = nn.Linear(2, 1)
    update = _update(Broken(model.parameters(), lr=0.1), model)
    model(torch.randn(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="^not a compile error$"):
        update.optimizer_step(step=0)


def test_the_shipped_bf16_configs_need_no_compile():
    """Every shipped config with bf16 weights trains with this AdamW (nothing compiled) and
    switches to ``torch.optim.AdamW`` by ``optimizer._component_`` alone: its block holds only
    keys ``torch.optim.AdamW`` takes."""
    import inspect

    from torchtune_grpo.config.loading import load_config, shipped_config_dir

    takes = set(inspect.signature(torch.optim.AdamW).parameters)
    checked = 0
    for path in sorted((shipped_config_dir() / "grpo").glob("*.yaml")):
        cfg = load_config(str(path))
        if cfg.get("dtype") != "bf16" or "optimizer" not in cfg:
            continue
        block = dict(cfg.optimizer)
        assert block.pop("_component_") == "torchtune_grpo.optim.AdamW", path.name
        assert set(block) <= takes, (path.name, set(block) - takes)
        checked += 1
    assert checked >= 10
