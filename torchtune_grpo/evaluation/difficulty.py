"""Difficulty files: each prompt's pass rate under a model (``tune-grpo difficulty``).

:func:`score_difficulty` samples every prompt of a config's dataset and appends one JSON
line per prompt, ``{"index", "question", "answer", "num_samples", "num_correct",
"pass_rate"}``, after a first line of settings; a rerun completes the file. A dataset built
with ``difficulty_file`` keeps the prompts inside ``difficulty_band`` (see
``docs/smollm2_ladder.md``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchtune_grpo.datasets.difficulty import _FORMAT, read_difficulty

__all__ = ["score_difficulty"]

def _settings(cfg: Any, num_samples: int, temperature: float) -> dict[str, Any]:
    from omegaconf import OmegaConf

    dataset = OmegaConf.to_container(cfg.dataset, resolve=True)
    dataset.pop("difficulty_file", None)
    dataset.pop("difficulty_band", None)
    return {
        "format": _FORMAT,
        "checkpoint_dir": str(cfg.checkpointer.get("checkpoint_dir")),
        "dataset": dataset,
        "num_samples": int(num_samples),
        "temperature": float(temperature),
        "max_generated_tokens": int(cfg.max_generated_tokens),
        "seed": int(cfg.get("seed", 0)),
    }


def _open_for_append(out: Path, settings: dict[str, Any]) -> tuple[set[int], Any]:
    """The indices already scored, and the file opened for appending (the settings line written
    when new, a cut-off last line removed).
    """
    if out.exists() and out.stat().st_size > 0:
        have, rows = read_difficulty(out)
        same = {k: have.get(k) for k in settings} == settings
        if not same:
            raise ValueError(
                f"--out {str(out)!r} holds pass rates made with other settings "
                f"({json.dumps({k: have.get(k) for k in settings if have.get(k) != settings[k]})}"
                f" vs {json.dumps({k: v for k, v in settings.items() if have.get(k) != v})}); "
                "write to another file or delete it")
        text = out.read_text()
        complete = text if text.endswith("\n") else text[: text.rfind("\n") + 1]
        if complete != text:
            out.write_text(complete)
        return set(rows), out.open("a")
    out.parent.mkdir(parents=True, exist_ok=True)
    handle = out.open("w")
    handle.write(json.dumps(settings) + "\n")
    handle.flush()
    return set(), handle


def score_difficulty(
    cfg: Any,
    out: str | Path,
    *,
    num_samples: int = 8,
    temperature: float | None = None,
    chunk_prompts: int | None = None,
    progress: bool = True,
) -> Path:
    """Write (or complete) the difficulty file of ``cfg.dataset`` under ``cfg``'s model.

    Args:
        cfg: a training or eval config (``model``, ``tokenizer``, ``checkpointer``,
            ``dataset``, ``rewards``, ``max_generated_tokens``, ``device``, ``dtype``).
        out: the JSONL file to write; an existing one made with the same settings is completed.
        num_samples: completions per prompt (``>= 2``).
        temperature: sampling temperature (``None``: the config's ``temperature``, else 1.0).
        chunk_prompts: prompts scored (and appended) at a time (``None``: as many as fit
            ``forward_batch_size`` rollouts, at least 1).
        progress: show a progress bar.

    Returns:
        ``out``.

    Raises:
        ValueError: ``num_samples`` below 2, a temperature not above 0, or an ``out`` file made
            with other settings.
    """
    from torchtune import config, training, utils
    from tqdm import tqdm

    from torchtune_grpo.evaluation.evaluate import evaluate
    from torchtune_grpo.evaluation.settings import EvalSettings
    from torchtune_grpo.policy.model import DTYPES, build_model, token_rules
    from torchtune_grpo.rewards.build import build_reward_set

    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"--num-samples must be an integer >= 2, got {num_samples!r}")
    temperature = float(cfg.get("temperature", 1.0) if temperature is None else temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    out = Path(out)
    settings = _settings(cfg, num_samples, temperature)
    done, handle = _open_for_append(out, settings)  # before loading anything
    try:
        rewards = build_reward_set(cfg.rewards)
        tokenizer = config.instantiate(cfg.tokenizer)
        dataset_cfg = cfg.dataset.copy()
        for key in ("difficulty_file", "difficulty_band"):
            dataset_cfg.pop(key, None)
        dataset = config.instantiate(dataset_cfg, tokenizer=tokenizer)
        pending = [i for i in range(len(dataset)) if int(dataset[i]["index"]) not in done]
        device = utils.get_device(cfg.get("device", "cpu"))
        dtype = DTYPES[cfg.get("dtype", "fp32")]
        if pending:
            state = config.instantiate(cfg.checkpointer).load_checkpoint()[training.MODEL_KEY]
            model = build_model(cfg.model, state, device=device, dtype=dtype, world_size=1,
                                trainable=False)
            del state
            rules = token_rules(tokenizer, model, device)
        fbs = int(cfg.get("forward_batch_size") or 64)
        per_chunk = chunk_prompts or max(1, fbs // num_samples)
        eval_settings = EvalSettings(num_samples=num_samples, temperature=temperature,
                                     top_k=cfg.get("top_k"), k=[1],
                                     max_generated_tokens=int(cfg.max_generated_tokens),
                                     forward_batch_size=max(fbs, num_samples),
                                     seed=int(cfg.get("seed", 0)))
        bar = tqdm(total=len(dataset), initial=len(dataset) - len(pending), disable=not progress,
                   desc="difficulty", dynamic_ncols=True, mininterval=5.0)
        start = time.perf_counter()
        for offset in range(0, len(pending), per_chunk):
            chunk = _Subset(dataset, pending[offset: offset + per_chunk])
            result = evaluate(model, tokenizer, chunk, rewards, eval_settings, device=device,
                              logit_bias=rules.logit_bias, allowed_tokens=rules.allowed,
                              stop_tokens=rules.stop_tokens, pad_id=rules.pad_id,
                              cache_dtype=dtype)
            for row in result.samples:
                correct = int(sum(row["correct"]))
                handle.write(json.dumps({
                    "index": row["index"], "question": row["question"], "answer": row["gold"],
                    "num_samples": num_samples, "num_correct": correct,
                    "pass_rate": correct / num_samples}) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            bar.update(len(chunk))
        bar.close()
        if pending:
            rate = len(pending) / max(time.perf_counter() - start, 1e-9)
            print(f"scored {len(pending)} prompts ({rate:.2f}/s)")
    finally:
        handle.close()
    _, rows = read_difficulty(out)
    rates = [r["pass_rate"] for r in rows.values()]
    some = sum(0 < r < 1 for r in rates)
    print(f"{out}: {len(rates)} prompts, mean pass rate {sum(rates) / len(rates):.3f}, "
          f"{some} ({some / len(rates):.0%}) solved sometimes, "
          f"{sum(r == 0 for r in rates)} never, {sum(r == 1 for r in rates)} always")
    return out


class _Subset:
    """Some items of a prompt dataset, in the order given (for :func:`evaluate`)."""

    def __init__(self, dataset: Any, positions: list[int]) -> None:
        self.dataset, self.positions = dataset, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> Mapping[str, Any]:
        return self.dataset[self.positions[i]]
