"""Every supported family against ``transformers``: logits, greedy decoding, packed training
forwards, save/reload and LoRA, one parametrised suite (issue 45, items 3a-3d).

Each case of :mod:`tests.unit.models.families._family_zoo` writes a tiny random model with
``save_pretrained``
(wide weights, norms off their initial values, sliding windows of 8 shorter than the rows) and
builds ours from the folder with :func:`hf_model` and :func:`hf_checkpointer` (the model type
derived from ``config.json``). Family-specific checks (a broken variant of each guard, config
refusals, vLLM names) live in the family's own test module.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtune import training  # noqa: E402
from torchtune.modules.peft import get_adapter_state_dict, get_merged_lora_ckpt  # noqa: E402

from tests.unit.models.families._family_zoo import CASES, SMALL, write_model  # noqa: E402
from torchtune_grpo.models import (  # noqa: E402
    hf_checkpointer,  # noqa: E402
    hf_model,
    lora_hf_model,
)
from torchtune_grpo.policy.positions import attention_mask, position_ids  # noqa: E402
from torchtune_grpo.rollout.native import generate_trajectory  # noqa: E402
from torchtune_grpo.rollout.protocol import GenerationRequest  # noqa: E402

V = SMALL["vocab_size"]
FAST = [case for case in CASES if case.fast]
#: The first case of each architecture: greedy decoding (the slowest check) runs on these in the
#: fast tier and on the other cases in the slow tier.
FIRST = {case.name for case in {c.architecture: c for c in reversed(FAST)}.values()}
GREEDY = [pytest.param(case, id=case.name,
                       marks=() if case.name in FIRST else pytest.mark.slow) for case in FAST]


@pytest.fixture(scope="module", params=FAST, ids=[case.name for case in FAST])
def folder(request, tmp_path_factory):
    """``(folder, transformers model, case)``."""
    path = tmp_path_factory.mktemp("family") / request.param.name
    return path, write_model(path, request.param), request.param


def ours(path, tmp_path, **kwargs):
    """Our model built from ``path`` with its weights, in eval mode, and its checkpointer."""
    model = hf_model(str(path), **kwargs)
    ckpt = hf_checkpointer(str(path), output_dir=str(tmp_path / "ckpt_out"))
    model.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY])
    return model.eval(), ckpt


def left_padded(starts: list[int], length: int, seed: int = 1):
    """``tokens [n, length]`` with row ``i`` padded (id 0) before ``starts[i]``, and its mask."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (len(starts), length), generator=generator)
    mask = torch.arange(length)[None] >= torch.tensor(starts)[:, None]
    return tokens.masked_fill(~mask, 0), mask


def hf_logits(ref, tokens, mask):
    """``transformers``' logits for a left-padded batch."""
    with torch.no_grad():
        return ref(tokens, attention_mask=mask.long(), position_ids=position_ids(mask)).logits


def logit_diff(model, ref, tokens, mask) -> float:
    """Largest |ours - transformers| over the real positions."""
    with torch.no_grad():
        got = model(tokens, mask=attention_mask(mask), input_pos=position_ids(mask))
    return (got - hf_logits(ref, tokens, mask)).abs()[mask].max().item()


# ------------------------------------------------------------------------- (a) logits
def test_logits_match_transformers_left_padded(folder, tmp_path):
    """Rows of 40, 35 and 23 real tokens (all longer than a sliding window of 8)."""
    path, ref, case = folder
    model, _ = ours(path, tmp_path)
    tokens, mask = left_padded([0, 5, 17], 40)
    diff = logit_diff(model, ref, tokens, mask)
    print(f"{case.name}: max |logit diff| vs transformers = {diff:.3g}")
    assert hf_logits(ref, tokens, mask)[mask].abs().max() > 3.0  # not degenerate
    assert diff <= 1e-4
    assert ("output.weight" in dict(model.named_parameters())) == (not case.tied)


def test_no_mask_forward_matches(folder, tmp_path):
    """Without a mask (plain causal), as ``model(tokens)`` is called by users and tests."""
    path, ref, _ = folder
    model, _ = ours(path, tmp_path)
    tokens, _ = left_padded([0, 0], 30, seed=3)
    with torch.no_grad():
        assert (model(tokens) - ref(tokens).logits).abs().max() <= 1e-4


# ------------------------------------------------------------------------- (b) greedy decoding
@pytest.mark.parametrize("folder", GREEDY, indirect=True)
@pytest.mark.parametrize("packed", [True, False], ids=["packed_weights", "plain_linear"])
def test_greedy_generation_matches_transformers(folder, tmp_path, packed):
    """64 greedy tokens of the native engine equal ``transformers.generate``'s, row by row
    (fast tier: the first case of each architecture; slow tier: the others)."""
    path, ref, _ = folder
    model, _ = ours(path, tmp_path)
    tokens, mask = left_padded([0, 3, 9], 12, seed=2)
    eos, new = V - 1, 64
    traj = generate_trajectory(model, GenerationRequest(tokens, mask, group_size=1,
        forward_batch_size=3, max_generated_tokens=new, temperature=0.0, top_k=None,
        stop_tokens=torch.tensor([eos]), pad_id=0),
        packed_weights=packed)
    with torch.no_grad():
        out = ref.generate(tokens, attention_mask=mask.long(), max_new_tokens=new,
                           do_sample=False, eos_token_id=eos, pad_token_id=0)
    theirs = out[:, tokens.shape[1]:].tolist()
    for row, (ours_row, row_mask, hf_row) in enumerate(zip(
            traj.response_tokens.tolist(), traj.response_mask.tolist(), theirs)):
        ours_ids = [t for t, m in zip(ours_row, row_mask) if m]
        hf_ids = hf_row[: hf_row.index(eos) + 1] if eos in hf_row else hf_row
        assert len(ours_ids) >= 16, row  # well past a window of 8
        assert ours_ids == hf_ids[: len(ours_ids)], row
        assert len(ours_ids) == len(hf_ids) or ours_ids[-1] == eos and hf_ids[-1] == eos, row


def test_packed_training_forward_matches_padded(folder, tmp_path):
    """Training log-probs with rows packed end to end equal the padded rectangle's."""
    from torchtune_grpo.policy.forward import micro_batch_logprobs

    path, _, _ = folder
    model, _ = ours(path, tmp_path)
    tokens, prompt_mask = left_padded([0, 4, 7], 14, seed=4)
    response = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(5))
    response_mask = torch.arange(6)[None] < torch.tensor([6, 3, 5])[:, None]
    full = torch.cat([tokens, response], dim=1)
    with torch.no_grad():
        padded, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, trim=False)
        packed, _ = micro_batch_logprobs(model, full, prompt_mask, response_mask, pack=True)
    assert padded[response_mask].abs().max() > 1.0
    torch.testing.assert_close(packed[response_mask], padded[response_mask], atol=1e-5,
                               rtol=1e-5)


# ------------------------------------------------------------------------- (c) save / reload
def test_save_reload_in_transformers(folder, tmp_path):
    """Perturbed weights saved in the HF layout: ``transformers`` loads them with our logits,
    and we load them back bitwise."""
    path, _, case = folder
    model, ckpt = ours(path, tmp_path)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(0.01 * torch.randn_like(param))
    ckpt.save_checkpoint({training.MODEL_KEY: model.state_dict()}, epoch=1)
    out = tmp_path / "ckpt_out" / "epoch_1"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in index) == (not case.tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == case.architecture
    tokens, mask = left_padded([0, 6], 30)
    diff = logit_diff(model, loaded.eval(), tokens, mask)
    print(f"{case.name}: save/reload max |logit diff| = {diff:.3g}")
    assert diff <= case.reload_tol
    again, _ = ours(out, tmp_path / "again")
    for key, value in again.state_dict().items():
        assert value.equal(model.state_dict()[key]), key


# ------------------------------------------------------------------------- (d) LoRA
def test_lora_merged_save_loads_in_transformers(folder, tmp_path):
    """LoRA on every attention and MLP projection: the base equals transformers, the adapters
    move the logits, and the merged save (and the PEFT adapter names) load in transformers."""
    path, ref, _ = folder
    kw = dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"],
              apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8)
    lora = lora_hf_model(str(path), **kw)
    ckpt = hf_checkpointer(str(path), output_dir=str(tmp_path / "out"))
    missing = lora.load_state_dict(ckpt.load_checkpoint()[training.MODEL_KEY],
                                   strict=False).missing_keys
    assert missing and all("lora" in k for k in missing)
    lora.eval()
    tokens, mask = left_padded([0, 4], 24)
    run = dict(mask=attention_mask(mask), input_pos=position_ids(mask))
    with torch.no_grad():
        base = lora(tokens, **run)
        assert (base - hf_logits(ref, tokens, mask)).abs()[mask].max() <= 1e-4
        for name, param in lora.named_parameters():
            if "lora_b" in name:
                param.normal_(0, 0.2)
        adapted = lora(tokens, **run)
    assert (adapted - base).abs()[mask].max() > 0.1
    state = {k: v.clone() for k, v in lora.state_dict().items()}
    adapter = get_adapter_state_dict(state)
    ckpt.save_checkpoint({
        training.MODEL_KEY: get_merged_lora_ckpt(state, rank=4, alpha=8),
        training.ADAPTER_KEY: adapter,
        training.ADAPTER_CONFIG: {"r": 4, "lora_alpha": 8, "peft_type": "LORA",
                                  "target_modules": ["q_proj", "k_proj", "v_proj",
                                                     "output_proj", "w1", "w2", "w3"]},
    }, epoch=1)
    out = tmp_path / "out" / "epoch_1"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert (adapted - hf_logits(merged.eval(), tokens, mask)).abs()[mask].max() <= 1e-4
    from safetensors.torch import load_file

    names = {n for n, _ in merged.named_modules()}
    peft = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    modules = {key.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for key in peft}
    assert modules <= names and len(peft) == 2 * len(modules)
    assert set(config["target_modules"]) == {m.rsplit(".", 1)[1] for m in modules}
    # the PEFT adapter is the same update: scale * B @ A = merged - base, module by module
    # (a fused HF module's adapter has rank r per part: rank_pattern/alpha_pattern)
    base, after = ref.state_dict(), merged.state_dict()
    for module in modules:
        short = module.rsplit(".", 1)[1]
        scale = (config.get("alpha_pattern", {}).get(short, config["lora_alpha"])
                 / config.get("rank_pattern", {}).get(short, config["r"]))
        lora_a, lora_b = (peft[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
        assert lora_a.shape[0] == config.get("rank_pattern", {}).get(short, config["r"])
        torch.testing.assert_close(scale * lora_b @ lora_a,
                                   after[f"{module}.weight"] - base[f"{module}.weight"],
                                   atol=2e-5, rtol=1e-4,
                                   msg=lambda m, module=module: f"{module}: {m}")


# ------------------------------------------------------------------------- (e) FSDP2
def test_fsdp2_two_ranks_match_one_rank(tmp_path):
    """Every family FSDP2-sharded over two gloo ranks (one ``torchrun`` for all of them) gives
    the loss and gradient norm of one unsharded process on the same rows
    (``tests/unit/models/families/_fsdp_family_worker.py``). The recipe-level check (a whole GRPO
    step through
    ``tune run --nproc_per_node 2``) is ``tests/recipes/test_family_recipes.py`` (slow tier)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from tests.unit.models.families._fsdp_family_worker import loss_and_grad_norm

    cases = list({case.architecture: case for case in reversed(FAST)}.values())
    folders = []
    for case in cases:
        write_model(tmp_path / case.name, case)
        folders.append(str(tmp_path / case.name))
    root = Path(__file__).resolve().parents[4]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}:{__import__('os').environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "two_ranks.json"
    with socket.socket() as free:  # a port of its own: other torchruns may be running
        free.bind(("localhost", 0))
        port = free.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"localhost:{port}", "--nproc_per_node", "2",
         str(root / "tests/unit/models/families/_fsdp_family_worker.py"), str(out), *folders],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sharded = json.loads(out.read_text())
    for case, folder in zip(cases, folders):
        one, two = loss_and_grad_norm(folder), sharded[folder]
        print(f"{case.architecture}: 1 rank {one}, 2 ranks {two}")
        assert one["grad_norm"] > 0.1 and abs(one["loss"]) > 1e-3  # not degenerate
        assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6), case.name
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), case.name
