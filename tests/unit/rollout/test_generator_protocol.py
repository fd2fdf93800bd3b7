"""The generator protocol matches what the recipe calls, and the native engine implements it.

``tests/vllm_engine/test_vllm_generator.py`` runs :func:`assert_implements_generator` on the vLLM
engine (where vLLM is installed).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

import torchtune_grpo
from torchtune_grpo.rollout.native import NativeGenerator
from torchtune_grpo.rollout.protocol import Generator

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
    keyword_only = {p.name for p in inspect.signature(Generator.generate).parameters.values()
                    if p.kind is p.KEYWORD_ONLY}
    assert calls["generate"][1] == keyword_only  # every option the recipe passes, no other


def test_native_generator_implements_the_protocol(tiny_model):
    gen = NativeGenerator()
    assert isinstance(gen, Generator)
    assert_implements_generator(NativeGenerator)
    # the recipe's call, with every option at its "not given" value
    tokens = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = tokens != 0
    traj = gen.generate(tiny_model.eval(), tokens, mask, group_size=2, forward_batch_size=4,
                        max_generated_tokens=3, temperature=1.0, top_k=None,
                        stop_tokens=torch.tensor([1]), pad_id=0, logit_bias=None,
                        prompt_seeds=torch.tensor([3, 4]), all_done=None, cache_dtype=None)
    assert traj.tokens.shape[0] == 4 and traj.response_len <= 3
    assert torch.equal(traj.tokens[:, :3], tokens.repeat_interleave(2, dim=0))
    assert traj.logprobs.dtype == torch.float32
    assert (traj.logprobs[~traj.response_mask] == 0).all()


def test_an_object_missing_a_method_is_not_a_generator():
    class NoClose:
        def setup(self, context): ...
        def generate(self, model, prompt_tokens, prompt_mask, **kwargs): ...
        def needs_policy_logprobs(self, *, top_k): ...
        def before_update(self): ...
        def sync_weights(self, model): ...

    assert not isinstance(NoClose(), Generator)
