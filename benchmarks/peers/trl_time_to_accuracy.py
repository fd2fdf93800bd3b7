"""TRL's GRPOTrainer trained for a wall-time budget, its held-out accuracy measured on the way.

The peer of ``benchmarks/time_to_accuracy.py``, run with the Python of TRL's own venv (``bash
benchmarks/peers/setup_trl.sh`` makes ``.venv-trl``)::

    .venv-trl/bin/python benchmarks/peers/trl_time_to_accuracy.py --spec spec.json --out trl.json

``spec.json`` (written by ``benchmarks/time_to_accuracy.py`` from our run's config and recipe):

* ``model_dir``, ``threads``, ``seed``;
* the training shape: ``batch_size`` prompts x ``group_size`` completions per optimizer step,
  ``micro_batch_size`` completions per forward/backward (gradient accumulation over the rest),
  ``new_tokens``, ``temperature``, ``learning_rate``, ``weight_decay``, ``max_grad_norm``,
  ``epsilon_low`` / ``epsilon_high``;
* ``prompts_per_step``: for each step, in order, the prompt token ids our recipe drew (the
  model's chat template already applied) and their gold answers. They are decoded to text and
  given to TRL as plain, already templated prompts in that order (``shuffle_dataset=False``);
  the result records whether TRL's tokenization gives back the same ids and whether TRL drew
  them in the same order;
* ``heldout``: the held-out prompts (token ids, gold answers, problem indices), ``eval_new_tokens``,
  ``eval_batch_size``, ``stop_token_ids`` and ``pad_id``;
* ``scoring``: the scoring rule. ``module_file`` is our own ``torchtune_grpo/rewards/answers.py``
  (it imports only the standard library), loaded here by path: a completion is correct when its
  last number (``parse_number``) equals the gold answer's (``numbers_match`` with ``rel_tol``),
  which is ``NumericCorrectness(answer_tag=None)``, our reward and our held-out score. The same
  rule is TRL's reward;
* ``budget_s`` and ``eval_every_s``.

What TRL runs: one optimizer step per ``batch_size`` prompts x ``group_size`` completions (one
generation batch, ``steps_per_generation`` = gradient accumulation steps, so that the update is
split into micro-batches of ``micro_batch_size`` completions as ours is), ``beta=0`` (no
reference model), no vLLM, fp32 on CPU, no gradient checkpointing, ``loss_type="dapo"`` (token
mean over the whole generation batch, as our ``token_mean``) with the spec's epsilons, AdamW
(fused, as ours) at a constant learning rate, gradient clipping, ``num_iterations=1``.

Clock: training wall seconds from ``on_train_begin``, with the held-out evaluations taken out
(the clock pauses while they run). At the end of every optimizer step (``on_step_end``): once
the clock has passed the budget, training stops (the last step finishes, as ours does); else,
once it has passed the next multiple of ``eval_every_s``, the live policy is evaluated. Also
evaluated: the base model (in ``on_train_begin``, before any step) and the last step.

Held-out evaluation: greedy (``do_sample=False``), HF ``generate`` in left-padded batches of
``eval_batch_size`` prompts, up to ``eval_new_tokens`` new tokens, stopping at the spec's stop
ids; each completion is cut at its first stop id, decoded without special tokens and scored by
the spec's rule: the same prompts, decoding and rule as our recipe's evaluation.

``--out`` is rewritten after every evaluation (``"complete": false`` until the end), so a run
that is killed keeps its points.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def load_scorer(scoring: dict[str, Any]) -> Callable[[str, str], bool]:
    """The spec's scoring rule as ``correct(completion, gold) -> bool``.

    Args:
        scoring: ``{"rule": "last_number", "module_file": PATH, "rel_tol": float}``;
            ``module_file`` must define ``parse_number`` and ``numbers_match`` (our
            ``torchtune_grpo/rewards/answers.py``, standard library only).

    Raises:
        ValueError: an unknown rule, or a gold answer without a number (when scoring).
        FileNotFoundError: ``module_file`` does not exist.
    """
    if scoring.get("rule") != "last_number":
        raise ValueError(f"scoring rule must be 'last_number', got {scoring.get('rule')!r}")
    path = Path(scoring["module_file"])
    if not path.is_file():
        raise FileNotFoundError(f"the scoring module {path} does not exist")
    module_spec = importlib.util.spec_from_file_location("_tta_answers", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    rel_tol = float(scoring.get("rel_tol", 1e-6))

    def correct(completion: str, gold: str) -> bool:
        """Whether the last number of ``completion`` equals the gold answer's number."""
        expected = module.parse_number(str(gold))
        if expected is None:
            raise ValueError(f"gold answer {gold!r} holds no number")
        got = module.parse_number(completion)
        return got is not None and bool(module.numbers_match(got, expected, rel_tol))

    return correct


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``ids`` up to (without) the first id in ``stop_ids``."""
    stops = set(stop_ids)
    out = []
    for i in ids:
        if i in stops:
            break
        out.append(int(i))
    return out


def greedy_heldout(model, tokenizer, prompts: Sequence[Sequence[int]], answers: Sequence[str],
                   correct: Callable[[str, str], bool], *, new_tokens: int, batch_size: int,
                   stop_ids: Sequence[int], pad_id: int, generate=None) -> dict[str, Any]:
    """Greedy held-out accuracy of an HF causal LM on token-id prompts.

    Args:
        model: the HF model (evaluated in ``eval`` mode, its mode restored afterwards).
        tokenizer: its HF tokenizer (decodes the completions, special tokens skipped).
        prompts: the prompts' token ids.
        answers: their gold answers.
        correct: the scoring rule (:func:`load_scorer`).
        new_tokens: the most new tokens per completion.
        batch_size: prompts per ``generate`` call (left-padded with ``pad_id``).
        stop_ids: ids that end a completion.
        pad_id: the padding id.
        generate: the generate function to call (default: the model class's own
            ``generate``, bypassing any timing wrapper on the instance).

    Returns:
        ``{"accuracy", "correct": [bool], "completions": [str], "generated_tokens": int}``.
    """
    import torch
    from transformers import GenerationConfig

    if generate is None:
        generate = type(model).generate.__get__(model)
    config = GenerationConfig(do_sample=False, max_new_tokens=int(new_tokens),
                              eos_token_id=list(stop_ids), pad_token_id=int(pad_id))
    was_training = model.training
    model.eval()
    flags, texts, tokens = [], [], 0
    try:
        with torch.no_grad():
            for start in range(0, len(prompts), batch_size):
                chunk = [list(p) for p in prompts[start:start + batch_size]]
                width = max(len(p) for p in chunk)
                ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
                out = generate(input_ids=ids, attention_mask=mask, generation_config=config)
                for row, gold in zip(out[:, width:].tolist(),
                                     answers[start:start + batch_size]):
                    kept = cut_at_stop(row, stop_ids)
                    tokens += min(len(kept) + 1, len(row))  # the stop token counts, as ours
                    text = tokenizer.decode(kept, skip_special_tokens=True)
                    texts.append(text)
                    flags.append(bool(correct(text, gold)))
    finally:
        model.train(was_training)
    return {"accuracy": sum(flags) / max(len(flags), 1), "correct": flags,
            "completions": texts, "generated_tokens": tokens}


def _bits(flags: Sequence[bool]) -> str:
    return "".join("1" if f else "0" for f in flags)


def _write(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Train TRL's GRPOTrainer for the spec's budget; write the held-out points to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    t_start = time.perf_counter()

    import torch

    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    correct = load_scorer(spec["scoring"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    rows, ids_match, step_texts = [], True, []
    for step in spec["prompts_per_step"]:
        texts = []
        for ids, answer in zip(step["tokens"], step["answers"], strict=True):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            ids_match &= tokenizer(text)["input_ids"] == ids
            rows.append({"prompt": text, "answer": str(answer)})
            texts.append(text)
        step_texts.append(texts)
    total_steps = len(spec["prompts_per_step"])
    batch, group = int(spec["batch_size"]), int(spec["group_size"])
    micro = int(spec["micro_batch_size"])
    if (batch * group) % micro:
        raise ValueError(f"micro_batch_size {micro} must divide batch_size x group_size "
                         f"= {batch * group}")
    accumulation = batch * group // micro
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    config = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, steps_per_generation=accumulation,
        num_generations=group, max_completion_length=int(spec["new_tokens"]),
        temperature=float(spec["temperature"]), top_p=1.0, top_k=0, beta=0.0, use_vllm=False,
        num_iterations=1, loss_type="dapo", epsilon=float(spec["epsilon_low"]),
        epsilon_high=float(spec["epsilon_high"]), learning_rate=float(spec["learning_rate"]),
        weight_decay=float(spec["weight_decay"]), optim="adamw_torch_fused",
        max_grad_norm=float(spec["max_grad_norm"]), lr_scheduler_type="constant",
        warmup_steps=0, max_steps=total_steps, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, fp16=False, seed=int(spec["seed"]),
        shuffle_dataset=False, dataloader_num_workers=0, gradient_checkpointing=False,
        disable_tqdm=True, log_completions=False,
    )
    last_rewards: list[float] = []

    def last_number_reward(completions, answer, **_kwargs):
        """1.0 when the completion's last number equals the gold answer (the spec's rule)."""
        scores = [1.0 if correct(c if isinstance(c, str) else str(c), a) else 0.0
                  for c, a in zip(completions, answer, strict=True)]
        last_rewards[:] = scores
        return scores

    trainer = GRPOTrainer(model=model, reward_funcs=last_number_reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    heldout = spec["heldout"]

    def evaluate() -> dict[str, Any]:
        return greedy_heldout(
            policy, tokenizer, heldout["tokens"], heldout["answers"], correct,
            new_tokens=int(spec["eval_new_tokens"]), batch_size=int(spec["eval_batch_size"]),
            stop_ids=spec["stop_token_ids"], pad_id=int(spec["pad_id"]))

    # counters of the training loop; generation and rollouts through wrappers
    state: dict[str, Any] = {"generated_tokens": 0, "generation_seconds": 0.0, "order_ok": True,
                             "rollouts": 0, "paused": 0.0, "next_eval": float(spec["eval_every_s"])}
    original_generate = policy.generate

    def timed_generate(*a, **k):
        """The model's generate, timed."""
        t0 = time.perf_counter()
        out = original_generate(*a, **k)
        state["generation_seconds"] += time.perf_counter() - t0
        return out

    policy.generate = timed_generate
    gen_and_score = trainer._generate_and_score_completions

    def counted_gen_and_score(inputs, *a, **k):
        """TRL's rollout + rewards + advantages; counts tokens, checks the prompt order."""
        n = state["rollouts"]
        # each prompt's group_size rows are consecutive (TRL's RepeatSampler); a step may hold
        # the same problem twice, so the groups are compared, not the distinct texts
        texts = [x["prompt"] for x in inputs]
        groups = [texts[i:i + group] for i in range(0, len(texts), group)]
        prompts = [g[0] for g in groups]
        if (n >= len(step_texts) or prompts != step_texts[n]
                or any(len(set(g)) != 1 or len(g) != group for g in groups)):
            state["order_ok"] = False
        out = gen_and_score(inputs, *a, **k)
        state["rollouts"] = n + 1
        mask = out.get("completion_mask") if isinstance(out, dict) else None
        if mask is not None:
            state["generated_tokens"] += int(mask.sum())
        return out

    trainer._generate_and_score_completions = counted_gen_and_score
    result: dict[str, Any] = {
        "name": "trl", "complete": False, "settings": spec.get("settings"),
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "threads": torch.get_num_threads(), "budget_s": float(spec["budget_s"]),
        "eval_every_s": float(spec["eval_every_s"]), "prompt_ids_match": bool(ids_match),
        "spec_steps": total_steps, "points": [],
        "heldout_indices": heldout.get("indices"),
    }

    def train_seconds() -> float:
        return time.perf_counter() - state["t0"] - state["paused"]

    def record(step: int, seconds: float | None = None) -> dict[str, Any]:
        """Evaluate the live policy (clock paused) and rewrite ``--out``; ``seconds``: the
        training clock to record (default: now)."""
        t0 = time.perf_counter()
        started = "t0" in state
        if seconds is None:
            seconds = train_seconds() if started else 0.0
        cpu = time.process_time() - state["cpu0"] if started else 0.0
        ev = evaluate()
        point = {"step": step, "train_seconds": seconds, "cpu_seconds": cpu,
                 "generated_tokens": state["generated_tokens"],
                 "generation_seconds": state["generation_seconds"],
                 "heldout_accuracy": ev["accuracy"], "correct": _bits(ev["correct"]),
                 "reward_mean": (sum(last_rewards) / len(last_rewards)) if last_rewards
                 else None, "eval_seconds": time.perf_counter() - t0}
        if step == 0:
            point["completions"] = ev["completions"]
        result["points"].append(point)
        result["prompt_order_match"] = state["order_ok"]
        result["peak_memory_bytes"] = _peak_rss_bytes()
        _write(args.out, result)
        print(f"[trl] step {step}: {seconds:.1f} train s, held-out {ev['accuracy']:.3f} "
              f"({time.perf_counter() - t0:.1f} s to evaluate)", flush=True)
        if started:
            state["paused"] += time.perf_counter() - t0
        return point

    class Budget(TrainerCallback):
        """The training clock, the evaluation schedule and the budget."""

        def on_train_begin(self, args, state_, control, **kwargs):
            """Evaluate the base model, then start the clock."""
            result["setup_seconds"] = time.perf_counter() - t_start
            record(0)
            state["t0"], state["cpu0"] = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state_, control, **kwargs):
            """Stop once the budget is spent; evaluate on the schedule."""
            now = train_seconds()
            if now >= float(spec["budget_s"]):
                state["stopped_at"] = now
                control.should_training_stop = True
            elif now >= state["next_eval"]:
                record(state_.global_step)
                while state["next_eval"] <= now:
                    state["next_eval"] += float(spec["eval_every_s"])

    trainer.add_callback(Budget())
    trainer.train()
    steps = trainer.state.global_step
    end_seconds = state.get("stopped_at", train_seconds())
    if result["points"][-1]["step"] != steps:
        record(steps, end_seconds)
    result.update({
        "complete": True, "steps": steps, "end_train_seconds": end_seconds,
        "prompts_exhausted": steps >= total_steps and end_seconds < float(spec["budget_s"]),
        "prompt_order_match": state["order_ok"], "peak_memory_bytes": _peak_rss_bytes(),
        "total_wall_seconds": time.perf_counter() - t_start,
    })
    _write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
