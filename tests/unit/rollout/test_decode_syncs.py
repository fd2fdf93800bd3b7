"""The native decode loop reads nothing back to the host between stop checks.

CPU tests of GPU properties: on a GPU every host read of a device value (``.item()``,
``bool(t)``, ``int(t)``, ``.tolist()``) stalls the launch queue, and every collective of a
per-token stop vote is a round trip. Here they are counted on the CPU, where they cost nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_grpo import distributed as D
from torchtune_grpo.quickstart.tiny import tiny_llama
from torchtune_grpo.rollout.native import NativeGenerator, generate_trajectory
from torchtune_grpo.rollout.protocol import GenerationContext, GenerationRequest
from torchtune_grpo.rollout.seeding import counter_uniform, decode_uniforms

_SYNC_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


class _Syncs(TorchDispatchMode):
    """Counts ops that copy a device value to the host."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """Counts ``Tensor.tolist`` calls, which read CPU memory without dispatching an op (on CUDA
    they copy to the host)."""
    calls = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1) or tolist(t))
    return calls


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    return tiny_llama().eval()


def _request(tokens: int, interval: int, *, stops=(), rows: int = 4, **over) -> GenerationRequest:
    prompts = torch.randint(5, 300, (rows // 2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(group_size=2, prompt_seeds=torch.arange(rows // 2) + 7,
              max_generated_tokens=tokens, temperature=1.0,
              stop_tokens=torch.tensor(list(stops) or [-1]), pad_id=0,
              stop_check_interval=interval)
    kw.update(over)
    return GenerationRequest(prompts, torch.ones_like(prompts, dtype=torch.bool), **kw)


def _syncs(model, request, host_reads) -> int:
    before = len(host_reads)
    with _Syncs() as mode:
        generate_trajectory(model, request, packed_weights=False, shrink_finished=False)
    return mode.count + len(host_reads) - before


@pytest.mark.parametrize("interval", [1, 8])
def test_host_syncs_per_token_are_one_per_check(model, host_reads, interval):
    """Rows that never stop (no stop id can be sampled): the syncs added by 16 more decode
    steps are the checks in them, ``16 / interval`` (the loop before this made 2 per token)."""
    extra = _syncs(model, _request(32, interval), host_reads) - _syncs(
        model, _request(16, interval), host_reads)
    assert extra == 16 // interval


def test_ranks_vote_on_stopping_only_at_checks(model):
    votes = []

    def all_done(flag) -> bool:
        votes.append(flag)
        return bool(flag)

    generate_trajectory(model, _request(40, 8, all_done=all_done), packed_weights=False)
    # checks after steps 8, 16, 24, 32 (none after the last step), then the length vote
    # of the cut (a binary search over "is my longest <= k")
    assert all(isinstance(v, torch.Tensor) for v in votes[:4])
    assert all(isinstance(v, bool) for v in votes[4:])
    assert 4 < len(votes) <= 4 + 2 * 7


def _stopping_request(interval: int, **over) -> GenerationRequest:
    # ids 5..40 stop a row; the tiny model is peaked, so a high temperature makes rows end at
    # different steps
    return _request(48, interval, stops=range(5, 40), rows=8, temperature=40.0, **over)


@pytest.mark.parametrize("interval", [3, 16])
@pytest.mark.parametrize("shrink", [False, True])
def test_trajectory_is_the_same_for_any_interval(model, interval, shrink):
    ref = generate_trajectory(model, _stopping_request(1), packed_weights=False,
                              shrink_finished=shrink)
    got = generate_trajectory(model, _stopping_request(interval), packed_weights=False,
                              shrink_finished=shrink)
    lengths = ref.response_mask.sum(1)
    assert lengths.min() < lengths.max() < 48 and ref.stopped.all()  # not degenerate
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.response_mask, ref.response_mask)
    assert torch.equal(got.stopped, ref.stopped)
    if shrink:  # other batch sizes after a shrink: float32 rounding of the batch size
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    else:
        assert torch.equal(got.logprobs, ref.logprobs)


def test_one_decode_batch_for_the_whole_rollout_gives_the_same_rows(model):
    ref = generate_trajectory(model, _stopping_request(1, forward_batch_size=2),
                              packed_weights=False, shrink_finished=False)
    got = generate_trajectory(model, _stopping_request(1, forward_batch_size=2,
                                                       rollout_batch_size=8),
                              packed_weights=False, shrink_finished=False)
    assert torch.equal(got.tokens, ref.tokens)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_rollout_random_numbers_are_drawn_up_front_equal_to_the_counter_draws():
    seeds = torch.tensor([0, 1, 2**33 + 5, 77])
    table = decode_uniforms(seeds, 9, "cpu")
    assert table.shape == (4, 9) and table.dtype == torch.float64
    for t in range(9):
        assert torch.equal(table[:, t], counter_uniform(seeds, t))


@pytest.mark.parametrize(("dtype", "recompute"), [(torch.float32, False),
                                                  (torch.bfloat16, True)])
def test_engine_logprobs_reused_only_in_float32(dtype, recompute):
    engine = NativeGenerator()
    engine.setup(GenerationContext(model_dir="", model_type="LLAMA3_2", hf_config={},
                                   device=torch.device("cpu"), dtype=dtype, world_size=1,
                                   rank=0, max_len=64, allowed_tokens=torch.ones(8, dtype=bool)))
    assert engine.needs_policy_logprobs(top_k=None) is recompute


def test_hook_free_view_runs_the_same_arithmetic_without_hooks(model):
    calls = []
    handle = model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        view = D.hook_free_view(model)
        x = torch.randint(5, 300, (2, 7))
        assert torch.equal(view(x), model(x)) and len(calls) == 1  # the view ran no hook
        assert view.layers[0] is not model.layers[0]
        assert view.layers[0].attn.q_proj.weight is model.layers[0].attn.q_proj.weight
        view.layers[0].attn.kv_cache_marker = 1  # what is set on the view stays there
        assert not hasattr(model.layers[0].attn, "kv_cache_marker")
    finally:
        handle.remove()


def _compiled_fsdp_worker(rank: int, port: int, state_path: str, out_dir: str) -> None:
    import os

    from omegaconf import OmegaConf
    from torch._dynamo.utils import counters

    from torchtune_grpo.policy.model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    D.init_distributed(torch.device("cpu"))
    try:
        model = build_model(OmegaConf.create({"_component_":
                                              "torchtune_grpo.quickstart.tiny.tiny_llama"}),
                            torch.load(state_path), device=torch.device("cpu"),
                            dtype=torch.float32, world_size=2, trainable=True).eval()
        engine = NativeGenerator(compile_decode=True)
        engine.setup(GenerationContext(model_dir="", model_type="LLAMA3_2", hf_config={},
                                       device=torch.device("cpu"), dtype=torch.float32,
                                       world_size=2, rank=rank, max_len=64,
                                       allowed_tokens=torch.ones(8, dtype=torch.bool)))
        request = _request(12, 4, stops=range(5, 40), temperature=40.0,
                           all_done=lambda flag: D.WORLD.all_ranks_true(flag,
                                                                        torch.device("cpu")))
        request = GenerationRequest(request.prompt_tokens + rank, request.prompt_mask,
                                    **{f: getattr(request, f) for f in (
                                        "group_size", "prompt_seeds", "max_generated_tokens",
                                        "temperature", "stop_tokens", "pad_id",
                                        "stop_check_interval", "all_done")})
        with D.gathered_for_inference(model):
            eager = generate_trajectory(model, request, packed_weights=False)
            counters.clear()
            compiled = engine.generate(model, request)
        refused = None
        try:  # outside the gathered block the view would run on shards
            engine.generate(model, request)
        except ValueError as e:
            refused = str(e)
        torch.save({"eager": eager.tokens, "compiled": compiled.tokens,
                    "graphs": counters["stats"]["unique_graphs"],
                    "breaks": dict(counters["graph_break"]), "refused": refused},
                   f"{out_dir}/rank{rank}.pt")
        D.WORLD.barrier()
    finally:
        D.destroy()


@pytest.mark.slow
@pytest.mark.distributed
def test_compiled_decode_runs_on_two_fsdp_ranks_on_gathered_weights(tmp_path):
    """Two FSDP2 ranks (gloo): the compiled decode step runs as one graph (FSDP2's own hooks,
    which dynamo cannot trace, are not in the view it runs on) and decodes the eager tokens;
    outside ``gathered_for_inference`` the engine refuses in one line."""
    import torch.multiprocessing as mp

    from tests.recipes._helpers import free_port

    torch.manual_seed(0)
    torch.save(tiny_llama().state_dict(), tmp_path / "state.pt")
    mp.spawn(_compiled_fsdp_worker, args=(free_port(), str(tmp_path / "state.pt"),
                                          str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["compiled"], got["eager"])
        assert got["graphs"] == 1 and not got["breaks"]
        assert "rollout_gather_weights: true" in got["refused"]
