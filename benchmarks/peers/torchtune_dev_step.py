"""Worker: steps of torchtune's original dev GRPO recipe, timed by phase (run by ``step.py``).

Runs inside the peer's own environment (torchtune at HEAD installed from a source tree, see
``benchmarks/peers/setup_torchtune_dev.sh``), never in this project's: it imports nothing
from ``torchtune_grpo``. ``benchmarks/step.py --peer torchtune-dev`` writes a spec file and
starts this script with the peer's Python; the worker writes its timings back as JSON.

What runs is the recipe class of ``recipes/dev/grpo_full_finetune_distributed.py`` from the
given source tree, unchanged: ``setup(cfg)`` with a config built from its own
``3B_full_grpo.yaml`` (model, tokenizer, checkpointers, loss and sizes overridden to the
benchmark's shape; on CPU one shim: torchtune's ``get_memory_stats``, which the recipe calls
after loading the model and which raises on CPU, returns nothing), then per step the body of
its ``train()`` loop: ``generate_trajectory_batched`` (generation, policy and reference
log-probs from full logits, rewards, advantages) and ``ppo_epochs`` x (``grpo_step``,
gradient clipping, optimizer step).
Its data loader is bypassed: each step uses the prompt token ids that this project's recipe
had at the same step (right-padded with the tokenizer's pad id, as its ``padded_collate_rl``
does).

Phases: ``generation`` is the time inside its ``generate`` call; ``reference`` is the rest of
``generate_trajectory_batched`` (the no-grad policy and reference forwards over full logits,
rewards, advantages); ``update`` is the PPO loop. Peak memory is the process's ``VmHWM``.

Usage (normally through step.py)::

    <peer-python> benchmarks/peers/torchtune_dev_step.py --spec spec.json --out result.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from pathlib import Path


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_recipe_module(source: Path):
    """Import ``recipes/dev/grpo_full_finetune_distributed.py`` of a torchtune source tree."""
    path = source / "recipes" / "dev" / "grpo_full_finetune_distributed.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --torchtune-src must be a torchtune checkout")
    spec = importlib.util.spec_from_file_location("torchtune_dev_grpo_recipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_config(spec: dict, source: Path, workdir: Path):
    """The dev recipe's own ``3B_full_grpo.yaml`` with the benchmark's shape swapped in."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(source / "recipes" / "configs" / "dev" / "3B_full_grpo.yaml")
    model_dir = spec["model_dir"]
    checkpointer = {"_component_": "torchtune.training.FullModelHFCheckpointer",
                    "checkpoint_dir": model_dir, "checkpoint_files": ["model.safetensors"],
                    "recipe_checkpoint": None, "model_type": "LLAMA3_2"}
    overrides = {
        "output_dir": str(workdir / "out"), "base_model_path": model_dir,
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": f"{model_dir}/tokenizer.model",
                      "special_tokens_path": f"{model_dir}/tokenizer.json", "max_seq_len": None},
        # set up as the recipe does (its data loader is bypassed, see the module docstring)
        "dataset": {"_component_": "torchtune.dev.grpo.gsm8k.gsm8k_dataset", "source": "json",
                    "data_files": spec["gsm8k_file"], "name": None, "split": "train"},
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2", **spec["dims"]},
        "checkpointer": {**checkpointer, "output_dir": str(workdir / "out")},
        "ref_checkpointer": {**checkpointer, "output_dir": str(workdir / "out" / "ref")},
        "seed": 0, "shuffle": False,
        "batch_size": spec["batch_size"], "grpo_samples": spec["group_size"],
        "forward_batch_size": spec["batch_size"],  # all prompts in one rollout, as ours
        "max_generated_tokens": spec["new_tokens"], "ppo_epochs": 1, "num_steps": 10_000,
        "device": spec["device"], "dtype": "fp32",
        "enable_activation_checkpointing": False, "compile": False,
        # its own config's AdamW (fused: True), at this benchmark's learning rate and
        # weight decay
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-5, "weight_decay": 0.0,
                      "fused": True},
        "lr_scheduler": None,
        "loss": {"_component_": "torchtune.dev.grpo.loss.GRPOSimpleLoss", "kl_coeff": 0.01,
                 "epsilon": 0.2},
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger",
                          "log_dir": str(workdir / "logs")},
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
        "log_peak_memory_stats": False,
    }
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def run(spec: dict, source: Path, workdir: Path) -> dict:
    """Set the recipe up, run ``1 + steps`` steps; return per-phase seconds and peak memory."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    with socket.socket() as s:  # a free port for the one-process group the recipe starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    module = load_recipe_module(source)
    if spec["device"] == "cpu":
        # The one shim: its _setup_model logs torchtune's memory stats on rank 0
        # unconditionally, and torchtune.training.get_memory_stats raises on CPU.
        module.training.get_memory_stats = lambda device, reset_stats=True: {}
        module.training.log_memory_stats = lambda *args, **kwargs: None
    cfg = build_config(spec, source, workdir)
    recipe = module.GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)

    gen_seconds = [0.0]
    original_generate = module.generate

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original_generate(*args, **kwargs)
        finally:
            gen_seconds[0] += time.perf_counter() - t0

    module.generate = timed_generate
    pad_id = recipe._tokenizer.pad_id

    def collate(prompts: list[list[int]]) -> torch.Tensor:
        # right-padded with the pad id, as its padded_collate_rl does
        tokens = torch.full((len(prompts), max(map(len, prompts))), pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        return tokens.to(recipe._device)

    per_step = spec["prompts_per_step"]
    params = sum(p.numel() for p in recipe._model.parameters())

    rows = []
    recipe._optimizer.zero_grad()
    for step in range(1 + spec["steps"]):
        # the prompts this project's recipe had at the same step
        tokens = collate(per_step[step % len(per_step)]["tokens"])
        answers = per_step[step % len(per_step)]["answers"]
        gen_seconds[0] = 0.0
        t0 = time.perf_counter()
        trajectory = recipe.generate_trajectory_batched(tokens, answers)
        t1 = time.perf_counter()
        for _ in range(recipe._ppo_epochs):  # the body of its train() loop
            recipe.grpo_step(trajectory, tokens.shape[1])
            if recipe._clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(recipe._model.parameters(),
                                               max_norm=float(recipe._clip_grad_norm))
            recipe._optimizer.step()
            recipe._optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        times = {"generation": gen_seconds[0], "scoring": 0.0,
                 "reference": (t1 - t0) - gen_seconds[0], "update": t2 - t1, "total": t2 - t0,
                 "generated_tokens": int((~trajectory.response_padding_masks).sum())}
        print(f"torchtune-dev step {step}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in times.items() if isinstance(v, float)), flush=True)
        if step > 0:
            rows.append(times)
        del trajectory
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    torch.distributed.destroy_process_group()
    return {"variant": "torchtune-dev", "params": params, "steps": rows, "mean": mean,
            "peak_memory_bytes": peak_rss_bytes(), "memory_kind": "peak_rss",
            "torchtune_version": getattr(sys.modules.get("torchtune"), "__version__", "?")}


def main(argv: list[str] | None = None) -> int:
    """Entry point: read the spec, run, write the result JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    result = run(spec, Path(spec["torchtune_src"]), args.spec.parent)
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
