"""TRL's GRPOTrainer at the shape of ``benchmarks/real_step.py``: the peer, run with TRL's venv.

    .venv-trl/bin/python benchmarks/peers/trl_step.py --spec spec.json --out result.json

``spec.json`` (written by ``benchmarks/real_step.py``): the HF model folder, group size,
prompts per step, new tokens, timed steps, threads, temperature, and ``prompts_per_step``: for
each step (the warm-up first) the prompt token ids our recipe used (the model's own chat
template already applied) and their gold answers. They are decoded to text and given to TRL as
plain (already templated) prompts, in order (``shuffle_dataset=False``); the result records
whether TRL's tokenization gives back the same ids.

One optimizer step = one generation batch of ``batch_size`` prompts x ``group_size``
completions (``per_device_train_batch_size = batch_size x group_size``, no gradient
accumulation, ``steps_per_generation`` 1), ``beta=0`` (no reference model), no vLLM, fp32 on
CPU (``bf16=False``: TRL's default is bf16 autocast), no gradient checkpointing (TRL's default
turns it on; our recipe does not checkpoint the body), ``max_completion_length`` new tokens,
``loss_type="dapo"`` with epsilon 0.2 / 0.28 (token mean, as our config), AdamW
(``adamw_torch``) at lr 1e-5, gradient clipping 1.0. The reward is a cheap last-number
correctness check.

Timing: a ``TrainerCallback`` (``on_step_begin`` / ``on_step_end``) times each optimizer step;
the model's ``generate`` and the trainer's ``_generate_and_score_completions`` are wrapped to
split it into generation, scoring (the rest of ``_generate_and_score_completions``: rewards,
advantages, padding) and update (the rest of the step: the loss forward, backward and the
optimizer). The first step is a warm-up; the mean of the others is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _last_number_reward(completions, answer, **_kwargs):
    """1.0 when the completion's last number equals the gold answer, else 0.0."""
    out = []
    for text, gold in zip(completions, answer):
        numbers = re.findall(r"-?\d[\d,]*\.?\d*", text if isinstance(text, str) else str(text))
        value = numbers[-1].replace(",", "").rstrip(".") if numbers else None
        out.append(1.0 if value == str(gold).replace(",", "") else 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run ``1 + steps`` GRPOTrainer steps; write timings per phase and peak memory."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(open(args.spec).read())

    import torch

    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    rows, match = [], True
    for step in spec["prompts_per_step"]:
        for ids, answer in zip(step["tokens"], step["answers"]):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            match &= tokenizer(text)["input_ids"] == ids
            rows.append({"prompt": text, "answer": str(answer)})
    total_steps = len(spec["prompts_per_step"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    n = int(spec["batch_size"]) * int(spec["group_size"])
    config = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=n,
        gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=int(spec["group_size"]),
        max_completion_length=int(spec["new_tokens"]), temperature=float(spec["temperature"]),
        top_p=1.0, top_k=0, beta=0.0, use_vllm=False, num_iterations=1,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, learning_rate=1e-5,
        weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, lr_scheduler_type="constant",
        max_steps=total_steps, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, fp16=False, seed=0, shuffle_dataset=False,
        dataloader_num_workers=0, gradient_checkpointing=False, disable_tqdm=True,
        log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=_last_number_reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)

    current = {"generation": 0.0, "generate_and_score": 0.0}
    generate = trainer.model.generate

    def timed_generate(*a, **k):
        """The model's generate, timed."""
        t0 = time.perf_counter()
        out = generate(*a, **k)
        current["generation"] += time.perf_counter() - t0
        current["generated_tokens"] = current.get("generated_tokens", 0) + int(
            (out[:, k["input_ids"].shape[1]:] != tokenizer.pad_token_id).sum()
            if "input_ids" in k else 0)
        return out

    trainer.model.generate = timed_generate
    gen_and_score = trainer._generate_and_score_completions

    def timed_gen_and_score(*a, **k):
        """TRL's rollout + rewards + advantages, timed."""
        t0 = time.perf_counter()
        out = gen_and_score(*a, **k)
        current["generate_and_score"] += time.perf_counter() - t0
        mask = out.get("completion_mask") if isinstance(out, dict) else None
        if mask is not None:
            current["completion_tokens"] = current.get("completion_tokens", 0) + int(mask.sum())
        return out

    trainer._generate_and_score_completions = timed_gen_and_score
    steps = []

    class StepTimer(TrainerCallback):
        """Times each optimizer step and records its phases."""

        def on_step_begin(self, args, state, control, **kwargs):
            """Start the clock; reset the phase counters."""
            current.clear()
            current.update({"generation": 0.0, "generate_and_score": 0.0})
            current["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            """Stop the clock; split the step into its phases."""
            total = time.perf_counter() - current["t0"]
            steps.append({
                "total": total, "generation": current["generation"],
                "scoring": current["generate_and_score"] - current["generation"],
                "reference": 0.0, "update": total - current["generate_and_score"],
                "generated_tokens": current.get("completion_tokens",
                                                current.get("generated_tokens", 0)),
            })

    trainer.add_callback(StepTimer())
    trainer.train()
    timed = steps[1:] or steps
    keys = ["generation", "scoring", "reference", "update", "total", "generated_tokens"]
    mean = {k: sum(s[k] for s in timed) / len(timed) for k in keys}
    result = {"name": "trl", "trl_version": trl.__version__, "torch_version": torch.__version__,
              "steps": steps, "mean": mean, "prompt_ids_match": bool(match),
              "peak_memory_bytes": _peak_rss_bytes(), "threads": torch.get_num_threads()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
