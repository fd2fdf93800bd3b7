"""The generator protocol matches what the recipe calls, and the native engine implements it.

``tests/vllm_engine/test_vllm_generator.py`` runs :func:`assert_implements_generator` on the vLLM
engine (where vLLM is installed).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import torchtune_grpo
from torchtune_grpo.rollout.multiturn import ToolUseGenerator
from torchtune_grpo.rollout.native import NativeGenerator, generate_trajectory
from torchtune_grpo.rollout.protocol import GenerationRequest, Generator
from torchtune_grpo.rollout.seeding import mix_seeds
from torchtune_grpo.rollout.tool_trajectory import ToolStats
from torchtune_grpo.rollout.tools.calculator import Calculator

PACKAGE = Path(torchtune_grpo.__file__).parent
#: where the recipe calls its generator: the recipe, its parts and the rollout runtime
RECIPE_FILES = sorted([*(PACKAGE / "training").glob("recipe*.py"), PACKAGE / "rollout/runtime.py",
                       PACKAGE / "checkpoints/recipe_state.py",
                       PACKAGE / "evaluation/during_training.py"])


def protocol_methods() -> set[str]:
    """Names of the public methods of :class:`Generator`."""
    return {name for name, value in vars(Generator).items()
            if callable(value) and not name.startswith("_")}


def recipe_generator_calls() -> dict[str, tuple[int, set[str]]]:
    """What the recipe's modules call on their generator: ``self.generator.X(...)``,
    ``generator.X(...)``.

    Returns:
        ``{method: (positional argument count, keyword names)}`` (the union over its calls, the
        largest positional count).
    """
    calls: dict[str, tuple[int, set[str]]] = {}
    nodes = [n for f in RECIPE_FILES for n in ast.walk(ast.parse(f.read_text()))]
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if name != "generator":
            continue
        n_pos, keywords = calls.get(node.func.attr, (0, set()))
        calls[node.func.attr] = (max(n_pos, len(node.args)),
                                 keywords | {k.arg for k in node.keywords if k.arg})
    return calls


def assert_implements_generator(cls: type) -> None:
    """``cls`` subclasses the protocol, accepts every call the protocol allows and every call the
    recipe makes (an engine may add optional arguments, or collect those it ignores in
    ``**kwargs``)."""
    assert issubclass(cls, Generator)
    for method in protocol_methods():
        params = list(inspect.signature(getattr(Generator, method)).parameters.values())[1:]
        inspect.signature(getattr(cls, method)).bind(
            None, *[None for p in params if p.kind is p.POSITIONAL_OR_KEYWORD],
            **{p.name: None for p in params if p.kind is p.KEYWORD_ONLY})
    for method, (n_pos, keywords) in recipe_generator_calls().items():
        inspect.signature(getattr(cls, method)).bind(
            None, *[None] * n_pos, **dict.fromkeys(keywords))


def test_protocol_methods_are_the_recipes_calls():
    calls = recipe_generator_calls()
    assert set(calls) == protocol_methods()
    assert calls["generate"] == (2, set())  # generate(model, request): nothing else


def _request(**over) -> GenerationRequest:
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9]])
    kwargs = dict(group_size=2, forward_batch_size=4, max_generated_tokens=3, temperature=1.0,
                  stop_tokens=torch.tensor([1]), pad_id=0, prompt_seeds=torch.tensor([3, 4]))
    kwargs.update(over)
    return GenerationRequest(tokens, tokens != 0, **kwargs)


def test_native_generator_implements_the_protocol(tiny_model):
    gen = NativeGenerator()
    assert isinstance(gen, Generator)
    assert_implements_generator(NativeGenerator)
    request = _request()
    traj = gen.generate(tiny_model.eval(), request)
    assert traj.tokens.shape[0] == 4 and traj.response_len <= 3
    assert torch.equal(traj.tokens[:, :3], request.prompt_tokens.repeat_interleave(2, dim=0))
    assert traj.logprobs.dtype == torch.float32
    assert (traj.logprobs[~traj.response_mask] == 0).all()
    assert gen.runs_policy() and not gen.needs_policy_logprobs(top_k=5)
    assert gen.pop_stats() == ToolStats()


def test_the_request_is_frozen_and_checks_its_shapes():
    request = _request()
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.temperature = 0.5
    assert (request.num_prompts, request.num_rows, request.rows_per_forward) == (2, 4, 4)
    assert _request(forward_batch_size=None).rows_per_forward == 4
    # row b * G + g draws from mix_seeds(prompt_seeds[b], g)
    assert request.sample_seeds().tolist() == [
        int(mix_seeds(s, g)) for s in (3, 4) for g in range(2)]
    assert _request(prompt_seeds=None).sample_seeds() is None
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9]])
    with pytest.raises(ValueError, match="prompt_mask"):
        GenerationRequest(tokens, tokens[:, 1:] != 0, max_generated_tokens=3, temperature=1.0,
                          stop_tokens=torch.tensor([1]), pad_id=0)
    with pytest.raises(ValueError, match=r"prompt_tokens must be \[B, P\]"):
        GenerationRequest(tokens[0], tokens[0] != 0, max_generated_tokens=3, temperature=1.0,
                          stop_tokens=torch.tensor([1]), pad_id=0)
    with pytest.raises(ValueError, match=r"prompt_seeds must be \[2\]"):
        _request(prompt_seeds=torch.tensor([3]))
    for name in ("group_size", "max_generated_tokens", "forward_batch_size"):
        with pytest.raises(ValueError, match=name):
            _request(**{name: 0})


def test_the_base_answers_for_an_engine_with_weights_of_its_own():
    class Remote(Generator):
        def setup(self, context): ...
        def generate(self, model, request): ...
        def before_update(self): ...
        def sync_weights(self, model): ...
        def close(self): ...

    engine = Remote()
    assert isinstance(engine, Generator)
    assert not engine.runs_policy()
    assert not engine.needs_policy_logprobs(top_k=None)
    assert engine.pop_stats() == ToolStats()


def test_the_tool_loop_answers_for_its_inner_engine(tokenizer):
    class Counting(Generator):
        """An engine that runs the policy, needs its log-probs and has counts of its own."""

        def setup(self, context): ...
        def generate(self, model, request): ...
        def before_update(self): ...
        def sync_weights(self, model): ...
        def close(self): ...
        def runs_policy(self): return True
        def needs_policy_logprobs(self, *, top_k): return top_k is not None
        def pop_stats(self): return ToolStats(completions=3)

    assert ToolUseGenerator([Calculator()]).runs_policy()  # the native engine inside
    wrapped = ToolUseGenerator([Calculator()], tokenizer=tokenizer, inner=Counting())
    assert wrapped.runs_policy()
    assert wrapped.needs_policy_logprobs(top_k=4)
    assert not wrapped.needs_policy_logprobs(top_k=None)
    assert wrapped.pop_stats() == ToolStats(completions=3)
    twice = ToolUseGenerator([Calculator()], tokenizer=tokenizer,
                             inner=ToolUseGenerator([Calculator()], inner=Counting()))
    assert twice.runs_policy() and twice.pop_stats() == ToolStats(completions=3)
    own = ToolUseGenerator([Calculator()], tokenizer=tokenizer, inner=Remote())
    assert not own.runs_policy()


class Remote(Generator):
    """An engine with weights of its own: every answer from the protocol's base."""

    def setup(self, context): ...
    def generate(self, model, request): ...
    def before_update(self): ...
    def sync_weights(self, model): ...
    def close(self): ...


def test_compile_decode_builds_the_compiled_step_once_on_the_engine(tiny_model):
    """The compiled step is the engine's (built with it), passed to every rollout; the policy
    module is not written to."""
    engine = NativeGenerator(compile_decode=True)
    assert callable(engine.compiled_step)
    assert NativeGenerator().compiled_step is None
    before = set(vars(tiny_model))
    step = engine.compiled_step
    assert engine.compiled_step is step and set(vars(tiny_model)) == before


def test_the_static_decode_runs_the_given_step(tiny_model):
    """``compiled_step`` (here an eager stand-in, so no compiler runs) makes every decode step
    and is called with the policy as its first argument; tokens equal the eager engine's."""
    model = tiny_model.eval()
    calls = []

    def step(module, *args, **kwargs):
        calls.append(module)
        return module(*args, **kwargs)

    request = _request(max_generated_tokens=5, stop_tokens=torch.tensor([-1]))
    static = generate_trajectory(model, request, compiled_step=step)
    eager = generate_trajectory(model, request)
    assert len(calls) == 4 and all(m is model for m in calls)  # 5 tokens: 4 decode steps
    assert torch.equal(static.tokens, eager.tokens)
    torch.testing.assert_close(static.logprobs, eager.logprobs, atol=1e-5, rtol=0)


def test_an_object_missing_a_method_is_not_a_generator():
    class NoClose:
        def setup(self, context): ...
        def generate(self, model, request): ...
        def needs_policy_logprobs(self, *, top_k): ...
        def runs_policy(self): ...
        def pop_stats(self): ...
        def before_update(self): ...
        def sync_weights(self, model): ...

    assert not isinstance(NoClose(), Generator)
