"""``tune-grpo init MODEL_DIR``: a training config and an evaluation config for any supported
Hugging Face model folder.

The family comes from the folder's ``config.json`` (one line naming what is unsupported
otherwise); the configs read the folder through ``hf_model``, ``hf_tokenizer`` and
``hf_checkpointer``, so they work for every family. What differs by folder is decided from the
folder itself: a chat template that takes ``enable_thinking`` gets the thinking keys (the
reward reads the answer after the ``<think>`` block), a folder without a chat template (a base
model) gets a plain-text few-shot prompt, and the sizes follow the device (``cuda`` when torch
sees one, else ``cpu``: fp32 and a small batch). The evaluation config evaluates the base
model by default, the baseline every trained step is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from torchtune_grpo.errors import UserError

#: The tasks ``--task`` takes.
TASKS = ("gsm8k", "math", "arithmetic")

_GSM8K = {"_component_": "torchtune_grpo.datasets.gsm8k_dataset", "source": "openai/gsm8k",
          "name": "main", "template": "torchtune_grpo.datasets.GSM8K_PHRASE_TEMPLATE"}
_MATH_TRAIN = {"_component_": "torchtune_grpo.datasets.math_dataset",
               "source": "EleutherAI/hendrycks_math", "name": None}
_MATH_TEST = {"_component_": "torchtune_grpo.datasets.math_dataset",
              "source": "HuggingFaceH4/MATH-500"}
_ARITHMETIC = {"_component_": "torchtune_grpo.datasets.arithmetic_dataset"}
_FEW_SHOT = {"style": "equation",
             "template": "torchtune_grpo.datasets.EQUATION_FEW_SHOT_TEMPLATE"}


@dataclass(frozen=True)
class Folder:
    """What ``init`` reads from a model folder.

    Attributes:
        path: the folder (absolute).
        architecture: the HF class (``Qwen3ForCausalLM``).
        model_type: the checkpointer's model type (``QWEN3``).
        num_params: parameters of the model, counted on the meta device.
        max_positions: ``max_position_embeddings`` (None when absent).
        chat: the folder has a chat template.
        thinking: its chat template takes ``enable_thinking``.
    """

    path: Path
    architecture: str
    model_type: str
    num_params: int
    max_positions: int | None
    chat: bool
    thinking: bool


def read_folder(model_dir: str | Path) -> Folder:
    """Read ``model_dir``'s ``config.json`` and tokenizer files.

    Raises:
        UserError: the folder or its ``config.json`` is absent (download it first), or the
            architecture is not supported (one line each).
    """
    import torch

    from torchtune_grpo.models.builders import hf_architecture, hf_model, read_hf_config
    from torchtune_grpo.models.chat_template import find_chat_template

    path = Path(model_dir).expanduser().resolve()
    if not path.is_dir():
        raise UserError(f"MODEL_DIR: {path} does not exist (download the model first, e.g. "
                        f"`tune download ORG/NAME --output-dir {path}`)")
    if not (path / "config.json").is_file():
        raise UserError(f"MODEL_DIR: {path} has no config.json: it is not a Hugging Face model "
                        "folder (or its download is incomplete)")
    try:
        hf = read_hf_config(path)
        arch = hf_architecture(hf, where=str(path / "config.json"))
        with torch.device("meta"):
            num_params = sum(p.numel() for p in hf_model(str(path)).parameters())
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"MODEL_DIR: {path / 'config.json'}: {exc}") from None
    tokenizer_config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        import json

        try:
            tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        except ValueError as exc:
            raise UserError(f"MODEL_DIR: {path / 'tokenizer_config.json'} is not valid JSON "
                            f"({exc}): download the model again") from None
    template, _, _ = find_chat_template(path, tokenizer_config.get("chat_template"),
                                        path / "tokenizer_config.json")
    return Folder(path=path, architecture=arch.architecture, model_type=arch.model_type,
                  num_params=num_params, max_positions=hf.get("max_position_embeddings"),
                  chat=template is not None,
                  thinking=template is not None and "enable_thinking" in template)


def _task_blocks(task: str, folder: Folder, gpu: bool) -> dict[str, Any]:
    """The dataset, evaluation data, rewards and lengths of ``task`` for ``folder``."""
    think = {"think_tag": "think"} if folder.thinking else {}
    if task == "gsm8k":
        prompt, tokens = 384, (1024 if folder.thinking else 512) if gpu else 256
        train = {**_GSM8K, "split": "train", "max_prompt_tokens": prompt}
        test = {**_GSM8K, "split": "test"}
        rewards = [
            {"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
             "answer_tag": None, "answer_phrase": "The answer is", "fallback": "last_number",
             **think, "weight": 1.0, "success": True},
            {"_component_": "torchtune_grpo.rewards.components.AnswerPhraseFormat",
             "phrase": "The answer is", "weight": 0.1, "requires_success": True}]
    elif task == "math":
        prompt, tokens = 512, (2048 if folder.thinking else 1024) if gpu else 512
        train = {**_MATH_TRAIN, "split": "train", "max_prompt_tokens": prompt}
        test = {**_MATH_TEST, "split": "test"}
        rewards = [{"_component_": "torchtune_grpo.rewards.math_grading.MathEquivalence",
                    "timeout_s": 2.0, "weight": 1.0, "success": True}]
    else:
        prompt, tokens = 128, 512 if folder.thinking else 64
        few_shot = {} if folder.chat else _FEW_SHOT
        if not folder.chat:
            tokens = 12
        train = {**_ARITHMETIC, "split": "train", **few_shot}
        test = {**_ARITHMETIC, "split": "test", **few_shot}
        rewards = [{"_component_": "torchtune_grpo.rewards.components.NumericCorrectness",
                    "answer_tag": None, **think, "weight": 1.0, "success": True}]
    if not gpu:  # a CPU evaluation of the whole test split takes long: its first problems
        test["limit"] = 100
    return {"train": train, "test": test, "rewards": rewards, "prompt": prompt,
            "tokens": tokens}


def _tokenizer(folder: Folder, model_dir: str, max_seq_len: int) -> dict[str, Any]:
    node: dict[str, Any] = {"_component_": "torchtune_grpo.models.hf_tokenizer",
                            "path": model_dir, "max_seq_len": max_seq_len}
    if folder.thinking:
        node["enable_thinking"] = True
    if not folder.chat:
        node["stop_strings"] = ["\n"]  # a few-shot answer is the rest of its line
    return node


def training_config(folder: Folder, task: str, *, device: str,
                    output_dir: str) -> dict[str, Any]:
    """The training config of ``folder`` for ``task`` on ``device`` (``cpu`` or ``cuda``).

    Raises:
        UserError: ``task`` needs a chat template the folder lacks.
    """
    if task not in TASKS:
        raise UserError(f"--task: {task!r} is not one of {', '.join(TASKS)}")
    if not folder.chat and task != "arithmetic":
        raise UserError(f"MODEL_DIR: {folder.path} has no chat template (a base model): "
                        f"--task {task} prompts through one; --task arithmetic has a plain-text "
                        "few-shot prompt, or give the tokenizer a template "
                        "(tokenizer.chat_template=PATH in the written config)")
    gpu = device == "cuda"
    blocks = _task_blocks(task, folder, gpu)
    max_seq_len = blocks["prompt"] + blocks["tokens"]
    if folder.max_positions:
        max_seq_len = min(max_seq_len, int(folder.max_positions))
    big = folder.num_params > 1.5e9
    cfg: dict[str, Any] = {
        "output_dir": output_dir,
        "model_dir": str(folder.path),
        "seed": 0,
        "device": device,
        "dtype": "bf16" if gpu else "fp32",
        "model": {"_component_": "torchtune_grpo.models.hf_model", "model_dir": "${model_dir}",
                  "max_seq_len": max_seq_len},
        "tokenizer": _tokenizer(folder, "${model_dir}", max_seq_len),
        "checkpointer": {"_component_": "torchtune_grpo.models.hf_checkpointer",
                         "checkpoint_dir": "${model_dir}", "output_dir": "${output_dir}"},
        "dataset": blocks["train"],
        "eval_dataset": blocks["test"],
        "eval_every_n_steps": 50 if gpu else 25,
        "eval_at_start": True,
        "eval": {"num_samples": 1, "temperature": 0.0, "k": [1]},
        "rewards": blocks["rewards"],
        "loss": {"_component_": "torchtune_grpo.algorithm.loss.GRPOLoss", "epsilon_low": 0.2,
                 "epsilon_high": 0.28, "aggregation": "token_mean", "kl_coeff": 0.0},
        "optimizer": ({"_component_": "torchtune_grpo.optim.AdamW", "lr": 1e-6,
                       "weight_decay": 0.0} if gpu else
                      {"_component_": "torch.optim.AdamW", "lr": 1e-5, "weight_decay": 0.0,
                       "fused": True}),
        "lr_scheduler": ({"_component_": "torchtune.training.lr_schedulers."
                          "get_cosine_schedule_with_warmup", "num_warmup_steps": 10}
                         if gpu else None),
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": "${output_dir}/logs"},
        "batch_size": 8 if gpu else 4,
        "group_size": 16 if gpu else 8,
        "forward_batch_size": (8 if big else 16) if gpu else 32,
        "max_generated_tokens": blocks["tokens"],
        "temperature": 0.6 if folder.thinking else 0.8,
        "top_k": None,
        "generator": None,
        "ppo_epochs": 1,
        "num_steps": 200 if gpu else 50,
        "save_every_n_steps": 50 if gpu else 25,
        "keep_last_n_checkpoints": 2,
        "clip_grad_norm": 1.0,
        "enable_activation_checkpointing": gpu,
        "log_every_n_steps": 1,
        "log_peak_memory_stats": gpu,
    }
    return cfg


def eval_config(train: dict[str, Any]) -> dict[str, Any]:
    """The evaluation config that goes with the training config ``train``: the same model
    keys, data and rewards, greedy pass@1; ``checkpoint_dir`` is the base model folder."""
    model_dir = train["model_dir"]
    tokenizer = {**train["tokenizer"], "path": "${checkpoint_dir}"}
    return {
        "checkpoint_dir": model_dir,
        "seed": 0,
        "device": train["device"],
        "dtype": train["dtype"],
        "model": {**train["model"], "model_dir": "${checkpoint_dir}"},
        "tokenizer": tokenizer,
        "checkpointer": {"_component_": "torchtune_grpo.models.hf_checkpointer",
                         "checkpoint_dir": "${checkpoint_dir}"},
        "dataset": train["eval_dataset"],
        "rewards": train["rewards"],
        "num_samples": 1,
        "temperature": 0.0,
        "top_k": None,
        "k": [1],
        "max_generated_tokens": train["max_generated_tokens"],
        "forward_batch_size": 64 if train["device"] == "cuda" else 32,
        "progress_bar": True,
    }


def _header(folder: Folder, task: str, device: str, train_path: Path, eval_path: Path,
            memory: str | None) -> str:
    recipe = ("tune run --nproc_per_node 8 grpo_full_finetune_distributed" if device == "cuda"
              else "tune run grpo_full_finetune_distributed")
    lines = [
        f"# GRPO on {task} for {folder.path.name} ({folder.architecture}, "
        f"{_count(folder.num_params)} parameters), written by `tune-grpo init`.",
        f"# Device: {device}" + (" (bf16, AdamW with stochastic rounding)"
                                 if device == "cuda" else " (fp32, a small batch)") + ".",
    ]
    if folder.thinking:
        lines.append("# The chat template takes enable_thinking: the reward reads the answer "
                     "after the <think> block.")
    if not folder.chat:
        lines.append("# No chat template (a base model): a plain-text few-shot prompt.")
    if memory:
        lines.append(f"# Memory: {memory} (tune-grpo estimate-memory --config {train_path}).")
    lines += [
        "#",
        f"#   {recipe} --config {train_path}",
        f"#   tune run grpo_eval --config {eval_path}    # the base model: the baseline",
        f"#   tune run grpo_eval --config {eval_path} checkpoint_dir={{output_dir}}/step_N",
        "",
    ]
    return "\n".join(lines)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _memory_line(path: Path, device: str) -> str | None:
    """The estimated peak of the written config, or None where it cannot be estimated."""
    try:
        from torchtune_grpo.cli.memory_estimate import estimate_memory
        from torchtune_grpo.config.loading import load_config

        world = 8 if device == "cuda" else 1
        estimate = estimate_memory(load_config(str(path)), world)
        return f"about {estimate.peak_gib:.1f} GiB per rank on {world} rank(s)"
    except Exception:  # noqa: BLE001 - the header goes without it
        return None


def write_configs(model_dir: str | Path, *, task: str = "gsm8k", out: str | Path | None = None,
                  device: str | None = None, overwrite: bool = False) -> tuple[Path, Path]:
    """Write the training config (``out``, default ``grpo_<folder>_<task>.yaml``) and its
    evaluation config (``<out stem>_eval.yaml``) for ``model_dir``; both are validated first.

    Args:
        model_dir: a supported Hugging Face model folder.
        task: ``gsm8k``, ``math`` or ``arithmetic``.
        out: where the training config goes.
        device: ``cuda`` or ``cpu`` (default: ``cuda`` when torch sees a GPU).
        overwrite: replace existing files (default: refuse, naming them).

    Returns:
        ``(training config, evaluation config)`` paths.

    Raises:
        UserError: an unsupported or absent folder, an unknown task or device, or a file that
            exists without ``overwrite``.
    """
    import torch
    from omegaconf import OmegaConf

    from torchtune_grpo.config.schema import EVAL_KEYS
    from torchtune_grpo.config.validation import validate_config

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise UserError(f"--device: {device!r} is not cuda or cpu")
    folder = read_folder(model_dir)
    name = folder.path.name.replace(".", "_").replace("-", "_").lower()
    train_path = Path(out if out is not None else f"grpo_{name}_{task}.yaml").expanduser()
    eval_path = train_path.with_name(f"{train_path.stem}_eval{train_path.suffix or '.yaml'}")
    existing = [str(p) for p in (train_path, eval_path) if p.exists()]
    if existing and not overwrite:
        raise UserError(f"{' and '.join(existing)} already exist: choose another --out, or "
                        "pass --overwrite to replace them")
    train = training_config(folder, task, device=device,
                            output_dir=f"/tmp/grpo/{name}_{task}")
    evaluation = eval_config(train)
    validate_config(OmegaConf.create(train))
    validate_config(OmegaConf.create(evaluation), schema=EVAL_KEYS)
    train_path.parent.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_dump(train, sort_keys=False, width=100)
    train_path.write_text(_header(folder, task, device, train_path, eval_path, None) + body)
    memory = _memory_line(train_path, device)
    train_path.write_text(_header(folder, task, device, train_path, eval_path, memory) + body)
    eval_path.write_text(
        f"# Evaluation of {folder.path.name} on {task} (greedy pass@1), written by "
        "`tune-grpo init`;\n# checkpoint_dir is the base model: pass "
        "checkpoint_dir=OUTPUT_DIR/step_N for a trained step.\n"
        + yaml.safe_dump(evaluation, sort_keys=False, width=100))
    return train_path, eval_path
