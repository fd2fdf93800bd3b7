"""GPU benchmark: generation tokens/s, GRPO step time, MFU and peak memory of Qwen2.5 shapes.

One prepared script for one GPU and a few minutes, with nothing to download: random-weight
Qwen2.5-0.5B and Qwen2.5-3B decoders (:func:`torchtune.models.qwen2.qwen2` with the dimensions
of ``torchtune.models.qwen2_5.qwen2_5_0_5b`` / ``qwen2_5_3b``; the test checks they match) in
bf16, written as HF folders (``Qwen2ForCausalLM`` safetensors + ``config.json``) next to the
byte-level tiny tokenizer of :mod:`torchtune_grpo.quickstart.tiny`. For each shape it measures:

* **generation** tokens/s of the native engine
  (:func:`torchtune_grpo.rollout.native.generate_trajectory`, the GRPO arrangement: ``prompts``
  random prompts of ``prompt_len`` ids x ``group`` samples, each prompt prefilled once, no stop
  token, so exactly ``rows x new_tokens`` tokens) and of vLLM on the same workload when
  ``import vllm`` works (``skip_tokenizer_init=True``, prompt token ids, the recipe's
  ``VLLMGenerator`` settings: ``enforce_eager=True`` unless ``--vllm-cuda-graphs``; each shape in
  its own subprocess), skipped with the reason otherwise;
* one **GRPO step** through the real :class:`torchtune_grpo.training.recipe.GRPORecipe` (config from
  ``benchmarks/step.py``'s ``build_config``: GSM8K-style prompts of at most 200 tokens, the
  tiny tokenizer, ``NumericCorrectness``, ``kl_coeff: 0.01`` so the reference model runs,
  ``torch.optim.AdamW``, ``ppo_epochs: 1``, no activation checkpointing), split into
  generation / scoring / reference / update (``torch.cuda.synchronize`` at each boundary); 1
  warm-up step, then the mean of the timed steps;
* **MFU** of that step: model FLOPs / (seconds x peak bf16 FLOP/s), with::

      model FLOPs = 6 * N * trained_tokens + 2 * N * (prefill_tokens + generated_tokens
                                                       + reference_tokens)

  ``N``: every parameter, the tied embedding counted once (it is the output projection's
  matrix; the embedding lookup itself is free); ``trained_tokens``: prompt + response tokens
  (no padding) of every row, per PPO epoch; ``prefill_tokens``: prompt tokens once per prompt
  (the group shares its prefill); ``generated_tokens``: response tokens; ``reference_tokens``:
  prompt + response tokens of every row. Attention's ``QK^T`` / ``PV`` FLOPs are left out. The
  peak comes from ``--peak-tflops``, else a table by ``torch.cuda.get_device_name()``
  (:data:`PEAK_BF16_TFLOPS`, dense, no sparsity); MFU is also printed against the bf16 rate of
  a big square matmul measured in the same run;
* **peak memory** (``torch.cuda.max_memory_allocated``, reset before the recipe is built) next to
  :func:`torchtune_grpo.cli.memory_estimate.estimate_memory` (what
  ``tune-grpo estimate-memory`` prints) for the same config.

Every part runs under a time guard: when the rest of ``--time-budget`` is smaller than what a
part needs, it is skipped with a printed reason (and listed under ``skipped`` in the JSON). The
results go to ``--out`` as JSON, and a markdown table for ``docs/performance.md`` is printed.

Usage::

    python benchmarks/gpu.py --out gpu.json                 # one GPU, ~6-7 min
    python benchmarks/gpu.py --shapes 0.5b --out gpu.json   # one shape
    python benchmarks/gpu.py --device cpu --tiny --out t.json   # 2 layers, dim 64: the test

``--check-part NAME`` runs one part of ``scripts/gpu_check.sh`` instead (``check_optimizer``,
``check_decode``, ``check_grpo_step``, ``check_fsdp_gather``; ``benchmarks/gpu_check.py`` drives
them), writing its figures to ``--out`` as they come.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a file: python benchmarks/gpu.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import harness  # noqa: E402
from benchmarks.harness import REPO  # noqa: E402

#: Builder arguments of :func:`torchtune.models.qwen2.qwen2` per shape; ``0.5b`` and ``3b`` are
#: those of ``torchtune.models.qwen2_5.qwen2_5_0_5b`` and ``qwen2_5_3b``.
_QWEN = {"attn_dropout": 0.0, "norm_eps": 1e-6, "rope_base": 1_000_000.0,
         "tie_word_embeddings": True}
SHAPES: dict[str, dict] = {
    "0.5b": {"vocab_size": 151936, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
             "embed_dim": 896, "intermediate_dim": 4864, "max_seq_len": 32768, **_QWEN},
    "3b": {"vocab_size": 151936, "num_layers": 36, "num_heads": 16, "num_kv_heads": 2,
           "embed_dim": 2048, "intermediate_dim": 11008, "max_seq_len": 32768, **_QWEN},
}
#: The ``--tiny`` shape (CPU test): 2 layers, dim 64, vocab 512.
TINY = {"vocab_size": 512, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "embed_dim": 64,
        "intermediate_dim": 128, "max_seq_len": 512, **_QWEN}
#: torchtune's builder of each named shape (the test checks the dimensions above against it).
BUILDERS = {"0.5b": "torchtune.models.qwen2_5.qwen2_5_0_5b",
            "3b": "torchtune.models.qwen2_5.qwen2_5_3b"}
#: Dense bf16 peak TFLOP/s by a substring of ``torch.cuda.get_device_name()`` (first match).
PEAK_BF16_TFLOPS = [("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("H800", 989.0),
                    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0),
                    ("L4", 121.0), ("B200", 2250.0)]
NO_STOP = 10**9  # a stop id no model can emit


@dataclass
class Workload:
    """What one shape runs.

    Attributes:
        prompts: prompts per GRPO step (``batch_size``) and per generation run.
        group: samples per prompt (``group_size``).
        new_tokens: tokens generated per sample (``max_generated_tokens``).
        prompt_len: random prompt ids per prompt in the generation benchmark.
        steps: timed GRPO steps after the warm-up.
        forward_batch_size: rows per generation / update micro-batch.
        need_write_s: seconds writing the random-weight HF folder needs (time guard).
        need_step_s: seconds the GRPO part needs (build + warm-up + steps) for the time guard.
        need_gen_s: seconds the native generation part needs.
        need_vllm_s: seconds the vLLM part needs (engine start-up included).
    """

    prompts: int
    group: int
    new_tokens: int
    prompt_len: int
    steps: int
    forward_batch_size: int
    need_write_s: float
    need_step_s: float
    need_gen_s: float
    need_vllm_s: float


WORKLOADS = {
    "0.5b": Workload(prompts=8, group=8, new_tokens=256, prompt_len=128, steps=2,
                     forward_batch_size=32, need_write_s=10, need_step_s=60, need_gen_s=20,
                     need_vllm_s=90),
    "3b": Workload(prompts=4, group=8, new_tokens=256, prompt_len=128, steps=1,
                   forward_batch_size=16, need_write_s=30, need_step_s=90, need_gen_s=30,
                   need_vllm_s=120),
}
TINY_WORKLOAD = Workload(prompts=2, group=4, new_tokens=8, prompt_len=16, steps=1,
                         forward_batch_size=8, need_write_s=1, need_step_s=5, need_gen_s=1,
                         need_vllm_s=60)


class Budget:
    """Wall-clock guard: :meth:`allow` says whether a part still fits ``--time-budget``."""

    def __init__(self, seconds: float) -> None:
        """Start the clock for a budget of ``seconds``."""
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        """Seconds since the benchmark started."""
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.seconds - self.elapsed()

    def allow(self, part: str, need: float) -> bool:
        """True when ``need`` seconds are left; otherwise record and print why ``part`` is
        skipped."""
        if self.left() >= need:
            return True
        msg = (f"{part}: skipped, time budget at risk ({self.left():.0f} s of "
               f"{self.seconds:.0f} s left, the part needs ~{need:.0f} s)")
        print(msg, flush=True)
        self.skipped.append(msg)
        return False


# ---------------------------------------------------------------------------- helpers
def _sync(device) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _dtype(name: str):
    """``torch.bfloat16`` or ``torch.float32`` from the recipe's ``dtype`` name."""
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def peak_tflops(device, override: float | None) -> tuple[float | None, str]:
    """``(peak bf16 TFLOP/s or None, where it came from)``: ``--peak-tflops``, else the table."""
    import torch

    if override is not None:
        return override, "--peak-tflops"
    if torch.device(device).type != "cuda":
        return None, "no table entry for CPU (pass --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"table ({key} in {name!r})"
    return None, f"{name!r} not in the table (pass --peak-tflops)"


def matmul_tflops(device, dtype_name: str, size: int, repeats: int = 10) -> float:
    """Best measured TFLOP/s of a ``[size, size] @ [size, size]`` matmul in ``dtype``."""
    import torch

    dtype = _dtype(dtype_name)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)

    def five() -> None:
        for _ in range(5):
            a @ b
        _sync(device)

    return 2 * size**3 / (harness.best_seconds(five, repeats, warmup=0) / 5) / 1e12


def hf_qwen2_config(dims: dict, dtype_name: str) -> dict:
    """The HF ``config.json`` (``Qwen2ForCausalLM``) of a :func:`torchtune.models.qwen2.qwen2`
    model with builder arguments ``dims``."""
    from torchtune_grpo.quickstart.tiny import tiny_special_tokens

    special = tiny_special_tokens()
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": dims["embed_dim"], "intermediate_size": dims["intermediate_dim"],
        "num_hidden_layers": dims["num_layers"], "num_attention_heads": dims["num_heads"],
        "num_key_value_heads": dims["num_kv_heads"], "vocab_size": dims["vocab_size"],
        "max_position_embeddings": dims["max_seq_len"], "rms_norm_eps": dims["norm_eps"],
        "rope_theta": dims["rope_base"], "tie_word_embeddings": dims["tie_word_embeddings"],
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": dims["num_layers"], "attention_dropout": 0.0,
        "bos_token_id": special["<|begin_of_text|>"], "eos_token_id": special["<|end_of_text|>"],
        "torch_dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype_name],
    }


def random_qwen2(dims: dict, device, dtype_name: str):
    """A random-weight ``qwen2(**dims)`` on ``device`` in ``dtype`` (``torch.manual_seed(0)``).

    Matrices are drawn from ``N(0, 0.02)`` (HF's ``initializer_range``), so the tied output
    projection gives logits of a realistic scale; norms keep their ones, biases their init.
    """
    import torch
    from torchtune.models.qwen2 import qwen2
    from torchtune.training import set_default_dtype

    torch.manual_seed(0)
    with set_default_dtype(_dtype(dtype_name)), torch.device(device):
        model = qwen2(**dims)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    return model


def write_random_qwen2(dims: dict, directory: Path, device, dtype_name: str) -> int:
    """:func:`random_qwen2` written as an HF folder (safetensors, ``config.json``, the tiny
    tokenizer); returns its parameter count."""
    from safetensors.torch import save_file
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    from torchtune_grpo.quickstart.tiny import write_tiny_tokenizer

    model = random_qwen2(dims, device, dtype_name)
    params = sum(p.numel() for p in model.parameters())
    state = qwen2_tune_to_hf({k: v.detach().cpu() for k, v in model.state_dict().items()},
                             num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"],
                             dim=dims["embed_dim"],
                             tie_word_embeddings=dims["tie_word_embeddings"])
    del model
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_qwen2_config(dims, dtype_name),
                                                       indent=2))
    write_tiny_tokenizer(directory)
    return params


def grpo_config(model_dir: Path, workdir: Path, dims: dict, w: Workload, device: str,
                dtype_name: str):
    """The GRPO config of one shape: ``benchmarks/step.py``'s, with this model and workload."""
    from omegaconf import OmegaConf

    from benchmarks.step import build_config

    cfg = build_config(workdir, device, w.new_tokens)
    cfg.model_dir = str(model_dir)
    cfg.output_dir = str(workdir / "run")
    cfg.dtype = dtype_name
    cfg.model = OmegaConf.create({"_component_": "torchtune.models.qwen2.qwen2", **dims})
    cfg.checkpointer.model_type = "QWEN2"
    cfg.batch_size, cfg.group_size = w.prompts, w.group
    cfg.forward_batch_size = w.forward_batch_size
    cfg.enable_activation_checkpointing = False
    return cfg


def step_flops(params: int, tokens: dict) -> float:
    """Model FLOPs of one GRPO step (module docstring): 6 N trained + 2 N forward-only."""
    forward_only = tokens["prefill"] + tokens["generated"] + tokens["reference"]
    return 6 * params * tokens["trained"] + 2 * params * forward_only


# ---------------------------------------------------------------------------- parts
def bench_grpo_step(cfg, w: Workload, budget: Budget, device: str) -> tuple[dict, object]:
    """Warm-up + ``w.steps`` GRPO steps through ``GRPORecipe``; returns (results, recipe)."""
    import torch

    from torchtune_grpo.cli.memory_estimate import estimate_memory
    from torchtune_grpo.training.recipe import GRPORecipe

    cuda = torch.device(device).type == "cuda"
    baseline = 0
    if cuda:  # what an earlier shape left allocated (should be ~0) is part of the peak
        baseline = int(torch.cuda.memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    recipe = GRPORecipe(cfg)
    recipe.setup()
    setup_s = time.perf_counter() - t0
    params = sum(p.numel() for p in recipe.model.parameters())
    rows, warmup_s = [], None
    for step in range(1 + w.steps):
        if step > 0 and warmup_s is not None and budget.left() < warmup_s + 5:
            budget.allow(f"GRPO step {step}", warmup_s + 5)
            break
        batch = recipe.batches.batch(recipe.step)
        phases = harness.Phases(sync=lambda: _sync(device))
        with phases("generation"):
            traj = recipe.rollout(batch)
        with phases("scoring"):
            adv = recipe.advantages(recipe.score(traj, batch), traj)
        with phases("reference"):
            ref = recipe.reference_logprobs(traj)
        with phases("update"):
            recipe.update(traj, adv.advantages.to(recipe.device), ref)
        recipe.step += 1
        times = {**phases.seconds, "total": sum(phases.seconds.values())}
        prompt = int(traj.prompt_mask.sum())
        generated = int(traj.response_mask.sum())
        tokens = {"prefill": prompt // w.group, "generated": generated,
                  "trained": (prompt + generated) * int(cfg.ppo_epochs),
                  "reference": (prompt + generated) if ref is not None else 0}
        if step == 0:
            warmup_s = times["total"]
        else:
            rows.append({"seconds": times, "tokens": tokens,
                         "padded_prompt_len": int(traj.prompt_len)})
    peak = harness.peak_memory_bytes(device)
    estimate = estimate_memory(cfg, 1, name="gpu-benchmark")
    out = {"params": params, "setup_s": setup_s, "warmup_s": warmup_s, "steps": rows,
           "peak_memory_bytes": peak, "allocated_before_bytes": baseline,
           "memory_kind": "cuda_max_memory_allocated" if cuda else "peak_rss",
           "estimated_peak_bytes": estimate.peak_bytes, "estimated_peak_phase": estimate.peak_phase,
           "estimate": estimate.to_dict()["components"]}
    if rows:
        out["mean_seconds"] = harness.mean_of([r["seconds"] for r in rows])
        out["mean_tokens"] = harness.mean_of([r["tokens"] for r in rows])
        out["flops_per_step"] = step_flops(params, out["mean_tokens"])
        out["flops_formula"] = ("6*N*trained_tokens + 2*N*(prefill_tokens + generated_tokens + "
                                "reference_tokens); N = all parameters (tied embedding once); "
                                "attention score FLOPs not counted")
    return out, recipe


def bench_native_generation(model, dims: dict, w: Workload, device: str) -> dict:
    """Tokens/s of the native engine on ``w.prompts`` random prompts x ``w.group`` samples."""
    import torch

    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, dims["vocab_size"], (w.prompts, w.prompt_len), generator=gen)
    prompts = prompts.to(device)
    mask = torch.ones_like(prompts, dtype=torch.bool)
    rows = w.prompts * w.group
    stop = torch.tensor([NO_STOP], device=device)
    was_training = model.training
    model.eval()

    def go(new_tokens: int) -> float:
        """Seconds to generate ``new_tokens`` per row (checks that every row got them)."""
        _sync(device)
        t0 = time.perf_counter()
        traj = generate_trajectory(model, GenerationRequest(prompts, mask, group_size=w.group,
            forward_batch_size=rows, prompt_seeds=torch.arange(w.prompts),
            max_generated_tokens=new_tokens, temperature=1.0, top_k=None, stop_tokens=stop,
            pad_id=0, cache_dtype=next(model.parameters()).dtype))
        _sync(device)
        seconds = time.perf_counter() - t0
        assert int(traj.response_mask.sum()) == rows * new_tokens
        return seconds

    go(4)
    seconds = go(w.new_tokens)
    model.train(was_training)
    return {"rows": rows, "prompt_len": w.prompt_len, "new_tokens": w.new_tokens,
            "seconds": seconds, "tokens_per_second": rows * w.new_tokens / seconds}


def vllm_worker(model_dir: Path, w: Workload, vocab: int, dtype_name: str,
                cuda_graphs: bool) -> dict:
    """In a subprocess: vLLM tokens/s on the workload of :func:`bench_native_generation`."""
    import torch

    try:
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001 - not installed or not usable here
        return {"skipped": f"vllm does not import ({type(exc).__name__}: {str(exc)[:120]})"}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (w.prompts, w.prompt_len), generator=gen)
    inputs = [{"prompt_token_ids": p.tolist()} for p in prompts for _ in range(w.group)]
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True,
              dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype_name],
              max_model_len=w.prompt_len + w.new_tokens, gpu_memory_utilization=0.5,
              enforce_eager=not cuda_graphs, seed=0)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=1.0, max_tokens=w.new_tokens, min_tokens=w.new_tokens,
                            ignore_eos=True, detokenize=False)
    llm.generate(inputs[:2], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True,
                                            detokenize=False), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"rows": len(inputs), "prompt_len": w.prompt_len, "new_tokens": w.new_tokens,
            "seconds": seconds, "tokens_per_second": tokens / seconds, "tokens": tokens,
            "startup_s": startup, "enforce_eager": not cuda_graphs}


def bench_vllm(model_dir: Path, name: str, w: Workload, dims: dict, args,
               budget: Budget) -> dict:
    """Run :func:`vllm_worker` in a subprocess (own GPU memory, killed at the budget's end)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed (import vllm fails)"}
    if not budget.allow(f"[{name}] vLLM generation", w.need_vllm_s):
        return {"skipped": "time budget"}
    out = model_dir.parent / f"vllm_{name}.json"
    cmd = [sys.executable, __file__, "--vllm-worker", str(model_dir), "--worker-out", str(out),
           "--worker-shape", name, "--dtype", args.dtype]
    if args.tiny:
        cmd.append("--tiny")
    if args.vllm_cuda_graphs:
        cmd.append("--vllm-cuda-graphs")
    try:
        proc = subprocess.run(cmd, env=harness.subprocess_env(REPO),
                              timeout=max(10.0, budget.left()), capture_output=True, text=True)
        print(proc.stdout[-2000:], end="")
    except subprocess.TimeoutExpired:
        return {"skipped": f"vLLM did not finish within the time budget ({budget.seconds:.0f} s)"}
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        return {"skipped": f"vLLM failed (exit {proc.returncode}): {' | '.join(tail)[:300]}"}
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------- the GPU check
#: The shipped config whose settings the check's GRPO step runs (with random weights).
CHECK_CONFIG = "grpo/qwen2_5_3B_full"
#: Rows of the decode measurement (one prompt of 16 samples, then four).
DECODE_ROWS = (16, 64)


class CheckPart:
    """One part of ``scripts/gpu_check.sh`` in this process: its figures go to ``out`` (JSON,
    rewritten after each figure, so that a part killed at its timeout still leaves what it had
    measured) and :attr:`result` is what it has measured so far."""

    def __init__(self, name: str, args) -> None:
        import torch

        self.args, self.out = args, args.out
        self.cuda = torch.device(args.device).type == "cuda"
        self.result: dict = {"part": name, "device": args.device, "dtype": args.dtype,
                             "tiny": args.tiny, "torch": torch.__version__}

    def record(self, **figures) -> None:
        """Add ``figures`` to the result and write it."""
        self.result.update(figures)
        if self.out:
            harness.write_json(self.out, self.result)

    def dims(self) -> dict:
        """The model shape of the part: Qwen2.5-3B's, or the tiny one (``--tiny``)."""
        return TINY if self.args.tiny else SHAPES["3b"]


@contextlib.contextmanager
def one_rank_group(cuda: bool):
    """A one-process ``torch.distributed`` group (NCCL on CUDA, gloo on CPU) for FSDP2."""
    import os
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        yield "nccl" if cuda else "gloo"
    finally:
        dist.destroy_process_group()


def fsdp2_shard(model) -> None:
    """Shard ``model`` with FSDP2 as the recipe does (each transformer layer, then the root)."""
    from functools import partial

    from torchtune import training

    training.shard_model(model, [partial(training.get_shard_conditions, names_to_match=None)],
                         cpu_offload=False)


def _error_line(exc: BaseException, optimizer=None) -> str:
    """One line for a failure of a measured piece (an optimizer's: as the recipe prints it)."""
    from torchtune_grpo.optim import _is_compile_error, compile_failure_line

    if optimizer is not None and _is_compile_error(exc):
        return compile_failure_line(optimizer, exc)
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"


def check_optimizer(part: CheckPart) -> None:
    """Part 1: the first step and 3 more of each bf16 AdamW on one FSDP2-sharded (one rank)
    transformer layer plus the tied embedding of the 3B shape: torchao's ``_AdamW`` as the GPU
    configs had it (``bf16_stochastic_round``: fails on FSDP2 shards in torchao 0.15), torchao's
    without it (torch.compile of each parameter's step: Triton on a GPU, a C++ compiler on
    CPU), ``torchtune_grpo.optim.AdamW`` (the configs' now) and ``torch.optim.AdamW``."""
    import torch
    import torchao.optim

    from torchtune_grpo.optim import AdamW
    from torchtune_grpo.policy.decoder import policy_decoder

    device = part.args.device
    variants = {
        "torchao._AdamW(bf16_stochastic_round)": lambda ps: torchao.optim._AdamW(
            ps, lr=1e-6, weight_decay=0.0, bf16_stochastic_round=True),
        "torchao._AdamW": lambda ps: torchao.optim._AdamW(ps, lr=1e-6, weight_decay=0.0),
        "torchtune_grpo.optim.AdamW": lambda ps: AdamW(ps, lr=1e-6, weight_decay=0.0),
        "torch.optim.AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-6, weight_decay=0.0),
    }
    with one_rank_group(part.cuda) as backend:
        model = policy_decoder(random_qwen2({**part.dims(), "num_layers": 1}, device,
                                            part.args.dtype))
        fsdp2_shard(model)
        tokens = torch.randint(0, 100, (2, 16), device=device)
        model(tokens).float().logsumexp(-1).mean().backward()
        params = [p for p in model.parameters() if p.grad is not None]
        part.record(backend=backend, params=sum(p.numel() for p in params),
                    shapes=len({tuple(p.shape) for p in params}), optimizers={})
        for name, make in variants.items():
            optimizer, row = make(params), {}
            try:
                for step in range(4):
                    _sync(device)
                    t0 = time.perf_counter()
                    optimizer.step()
                    _sync(device)
                    row["first_step_s" if step == 0 else f"step_{step}_s"] = (
                        time.perf_counter() - t0)
                row["step_ms"] = 1000 * sum(row[f"step_{i}_s"] for i in (1, 2, 3)) / 3
                row["status"] = "ran"
            except Exception as exc:  # noqa: BLE001 - each variant's failure is a figure
                row.update(status="failed", error=_error_line(exc, optimizer))
            del optimizer
            part.record(optimizers={**part.result["optimizers"], name: row})
            print(f"optimizer {name}: {row}", flush=True)


class _SyncCount:
    """Host syncs during a block: ``aten._local_scalar_dense`` / ``aten.is_nonzero`` (a
    ``TorchDispatchMode``, any device) and, on CUDA, the warnings of
    ``torch.cuda.set_sync_debug_mode("warn")`` (every synchronizing call, copies included).
    ``dispatch=False`` leaves the dispatch mode out (around a compiled step)."""

    def __init__(self, cuda: bool, dispatch: bool = True) -> None:
        self.cuda, self.dispatch, self.ops, self.warned = cuda, dispatch, 0, 0

    @contextlib.contextmanager
    def __call__(self):
        import warnings

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        names = {"aten._local_scalar_dense.default", "aten.is_nonzero.default"}
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.ops += str(func) in names
                return func(*args, **(kwargs or {}))

        mode = Mode() if self.dispatch else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as seen, mode:
            warnings.simplefilter("always")
            if self.cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
        self.warned += sum("synchroniz" in str(w.message) for w in seen)


def check_decode(part: CheckPart) -> None:
    """Part 2: native-engine decode ms per token and host syncs per token at 16 and 64 rows
    (the 3B shape, random weights, rows that never stop), from the difference between a
    ``2n``- and an ``n``-token rollout (prefill and set-up cancel), eager; then the compiled
    decode step (``NativeGenerator(compile_decode=True)``, CUDA graphs; CUDA only), which the
    part's time cap cuts if its compile is slow (the eager figures are written by then)."""
    import dataclasses

    import torch

    from torchtune_grpo.backends import backend_for
    from torchtune_grpo.policy.decoder import policy_decoder
    from torchtune_grpo.rollout.native import NativeGenerator, generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    device, dims = part.args.device, part.dims()
    n, prompt_len, group = (16, 16, 16) if part.args.tiny else (32, 128, 16)
    model = policy_decoder(random_qwen2(dims, device, part.args.dtype)).eval()
    interval = getattr(backend_for(torch.device(device)), "stop_check_interval", None)
    fields = {f.name for f in dataclasses.fields(GenerationRequest)}
    part.record(new_tokens=(n, 2 * n), prompt_len=prompt_len, stop_check_interval=interval,
                rows={})

    def request(rows: int, tokens: int):
        prompts = torch.randint(0, dims["vocab_size"], (rows // group, prompt_len),
                                generator=torch.Generator().manual_seed(0)).to(device)
        extra = {"stop_check_interval": interval, "rollout_batch_size": rows}
        return GenerationRequest(
            prompts, torch.ones_like(prompts, dtype=torch.bool), group_size=group,
            prompt_seeds=torch.arange(rows // group), max_generated_tokens=tokens,
            temperature=1.0, stop_tokens=torch.tensor([NO_STOP], device=device), pad_id=0,
            **{k: v for k, v in extra.items() if k in fields and v is not None})

    def measure(generate, rows: int, dispatch: bool) -> dict:
        for tokens in (n, 2 * n):  # warm-up at both cache sizes (and their compiles)
            generate(request(rows, tokens))
        seconds, syncs = [], []
        for tokens in (n, 2 * n):
            best = float("inf")
            for _ in range(1 if part.cuda else 2):  # a busy CPU host delays single runs
                count = _SyncCount(part.cuda, dispatch)
                _sync(device)
                t0 = time.perf_counter()
                with torch.no_grad(), count():
                    traj = generate(request(rows, tokens))
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            seconds.append(best)
            syncs.append((count.ops, count.warned))
            assert int(traj.response_mask.sum()) == rows * tokens
        return {"seconds": seconds, "ms_per_token": 1000 * (seconds[1] - seconds[0]) / n,
                "syncs_per_token": (syncs[1][0] - syncs[0][0]) / n if dispatch else None,
                "cuda_sync_warnings_per_token": ((syncs[1][1] - syncs[0][1]) / n
                                                 if part.cuda else None)}

    engines = {"eager": lambda r: generate_trajectory(model, r)}
    if part.cuda:
        generator = NativeGenerator(compile_decode=True, compile_mode="reduce-overhead")
        engines["compiled"] = lambda r: generator.generate(model, r)
    for engine, generate in engines.items():
        for rows in DECODE_ROWS:
            key = f"{engine}_{rows}"
            try:
                row = measure(generate, rows, dispatch=engine == "eager")
            except Exception as exc:  # noqa: BLE001 - a failure is a figure
                row = {"status": "failed", "error": _error_line(exc)}
            part.record(rows={**part.result["rows"], key: row})
            print(f"decode {key}: {row}", flush=True)
    if part.cuda:  # the CUDA graph's tokens against the eager loop's, same request
        try:
            same = request(DECODE_ROWS[0], n)
            equal = bool(torch.equal(engines["compiled"](same).tokens,
                                     generate_trajectory(model, same).tokens))
        except Exception as exc:  # noqa: BLE001 - a failure is a figure
            equal = _error_line(exc)
        part.record(compiled_tokens_equal_eager=equal)
        print(f"decode compiled tokens equal eager: {equal}", flush=True)
    if not part.cuda:
        part.record(compiled="skipped: GPU-only (CUDA graphs; the CPU compile is tested in "
                             "tests/unit/rollout)")


def step_config(part: CheckPart, model_dir: Path, workdir: Path):
    """:data:`CHECK_CONFIG` with its settings, on ``model_dir`` (random weights, the tiny
    tokenizer) and ``benchmarks/step.py``'s local GSM8K-style prompts; no evaluation, no
    checkpoint; zero-advantage rows kept. ``--tiny``: 2 prompts x 4 samples x 8 tokens."""
    from omegaconf import OmegaConf

    from benchmarks.step import build_config
    from torchtune_grpo.config.loading import load_config

    local = build_config(workdir, part.args.device, 8)
    cfg = load_config(CHECK_CONFIG, [
        f"model_dir={model_dir}", f"output_dir={workdir / 'run'}", f"device={part.args.device}",
        f"dtype={part.args.dtype}", "num_steps=2", "save_every_n_steps=null",
        "eval_every_n_steps=null", "eval_at_start=false", "progress_bar=false",
        # random weights earn equal rewards, so every advantage is 0: keep the rows, so that
        # the update (and its log-prob gap) does the work of a real step
        "skip_zero_advantage_sequences=false"])
    cfg.tokenizer, cfg.dataset = local.tokenizer, local.dataset
    cfg.eval_dataset = None
    if part.args.tiny:
        cfg.batch_size, cfg.group_size, cfg.max_generated_tokens = 2, 4, 8
        cfg.forward_batch_size = 8
    return OmegaConf.create(OmegaConf.to_container(cfg))


def check_grpo_step(part: CheckPart) -> None:
    """Parts 3 and 4: GRPO steps of :data:`CHECK_CONFIG`'s settings at its model shape (random
    weights, one rank): seconds per phase (the recipe's own timer), peak memory against
    ``tune-grpo estimate-memory``'s one-rank figure (``batch_size`` halved until the estimate
    fits 90% of the card, and said so), and the engine-trainer log-prob gap of the first epoch
    (``generation/logprob_diff_max`` / ``_mean``: bf16 decode against the training forward)."""
    import torch

    from torchtune_grpo.cli.memory_estimate import estimate_memory
    from torchtune_grpo.training.recipe import GRPORecipe

    device = part.args.device
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        t0 = time.perf_counter()
        params = write_random_qwen2(part.dims(), workdir / "model", device, part.args.dtype)
        cfg = step_config(part, workdir / "model", workdir)
        estimate = estimate_memory(cfg, 1, name=CHECK_CONFIG)
        card = torch.cuda.get_device_properties(device).total_memory if part.cuda else None
        while card and estimate.peak_bytes > 0.9 * card and cfg.batch_size > 1:
            cfg.batch_size //= 2
            rows = cfg.batch_size * cfg.group_size
            for key in ("forward_batch_size", "rollout_batch_size"):  # must divide the rows
                if cfg.get(key):
                    cfg[key] = math.gcd(int(cfg[key]), rows)
            estimate = estimate_memory(cfg, 1, name=CHECK_CONFIG)
        part.record(config=CHECK_CONFIG, params=params, write_s=time.perf_counter() - t0,
                    batch_size=cfg.batch_size, forward_batch_size=cfg.forward_batch_size,
                    group_size=cfg.group_size,
                    max_generated_tokens=cfg.max_generated_tokens,
                    optimizer=cfg.optimizer._component_, card_bytes=card,
                    estimated_peak_bytes=getattr(estimate, "allocated_peak_bytes",
                                                 estimate.peak_bytes),
                    estimated_peak_phase=estimate.peak_phase, steps=[])
        if part.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        recipe = GRPORecipe(cfg)
        try:
            t0 = time.perf_counter()
            recipe.setup()
            part.record(setup_s=time.perf_counter() - t0)
            for _ in range(2):
                metrics = recipe.train_step(recipe.batches.batch(recipe.step))
                _sync(device)
                row = {k: v for k, v in metrics.items()
                       if k.startswith(("time/", "generation/logprob_diff", "loss", "grad_norm",
                                        "response_length/mean"))}
                row["peak_memory_bytes"] = harness.peak_memory_bytes(device)
                part.record(steps=[*part.result["steps"], row])
                print(f"grpo step {len(part.result['steps'])}: {row}", flush=True)
        finally:
            recipe.cleanup()


def check_fsdp_gather(part: CheckPart) -> None:
    """Part 6: a one-rank FSDP2 model (NCCL on CUDA, gloo on CPU; the tiny shape) decodes
    through :func:`~torchtune_grpo.distributed.gathered_for_inference`: its tokens against the
    same model unsharded, and decode seconds gathered once vs gathered per forward."""
    import copy

    import torch

    from torchtune_grpo.distributed import gathered_for_inference
    from torchtune_grpo.policy.decoder import policy_decoder
    from torchtune_grpo.rollout.native import generate_trajectory
    from torchtune_grpo.rollout.protocol import GenerationRequest

    device = part.args.device
    prompts = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    prompts = prompts.to(device)
    request = GenerationRequest(
        prompts, torch.ones_like(prompts, dtype=torch.bool), group_size=4,
        prompt_seeds=torch.arange(2), max_generated_tokens=16, temperature=1.0,
        stop_tokens=torch.tensor([NO_STOP], device=device), pad_id=0)
    with one_rank_group(part.cuda) as backend, torch.no_grad():
        plain = policy_decoder(random_qwen2(TINY, device, part.args.dtype)).eval()
        sharded = copy.deepcopy(plain)
        fsdp2_shard(sharded)
        expected = generate_trajectory(plain, request)
        generate_trajectory(sharded, request)  # FSDP2's lazy initialisation, untimed
        seconds, equal, diff = {}, [], 0.0
        for name, enabled in (("gathered_once", True), ("per_forward", False)):
            _sync(device)
            t0 = time.perf_counter()
            with gathered_for_inference(sharded, enabled=enabled):
                got = generate_trajectory(sharded, request)
            _sync(device)
            seconds[name] = time.perf_counter() - t0
            equal.append(bool(torch.equal(got.tokens, expected.tokens)))
            diff = max(diff, float((got.logprobs - expected.logprobs).abs().max()))
        part.record(backend=backend, tokens_equal=all(equal), logprob_max_diff=diff,
                    decode_seconds=seconds)


CHECK_PARTS = {"optimizer": check_optimizer, "decode": check_decode,
               "grpo_step": check_grpo_step, "fsdp_gather": check_fsdp_gather}


# ---------------------------------------------------------------------------- driver
def bench_shape(name: str, dims: dict, w: Workload, args, budget: Budget, workdir: Path,
                rates: dict) -> dict:
    """GRPO step, native generation (same process) for one shape; vLLM comes later."""
    import torch

    result: dict = {"dims": dims, "workload": asdict(w), "builder": BUILDERS.get(name),
                    "generation": {}}
    model_dir = workdir / name / "model"
    if not budget.allow(f"[{name}] whole shape", w.need_write_s + w.need_gen_s):
        result["params"] = None
        result["grpo_step"] = {"skipped": "time budget"}
        result["generation"]["native"] = {"skipped": "time budget"}
        return result
    t0 = time.perf_counter()
    print(f"[{name}] writing the random-weight HF folder ...", flush=True)
    result["params"] = write_random_qwen2(dims, model_dir, args.device, args.dtype)
    result["write_s"] = time.perf_counter() - t0
    result["model_dir"] = str(model_dir)
    recipe = None
    if budget.allow(f"[{name}] GRPO step", w.need_step_s):
        print(f"[{name}] GRPO step ({w.prompts} prompts x {w.group} samples x {w.new_tokens} "
              f"new tokens, 1 warm-up + {w.steps}) ...", flush=True)
        cfg = grpo_config(model_dir, workdir / name, dims, w, args.device, args.dtype)
        step, recipe = bench_grpo_step(cfg, w, budget, args.device)
        if "flops_per_step" in step:
            seconds = step["mean_seconds"]["total"]
            achieved = step["flops_per_step"] / seconds / 1e12
            step["achieved_tflops"] = achieved
            step["mfu_vs_peak"] = achieved / rates["peak_tflops"] if rates["peak_tflops"] else None
            step["mfu_vs_matmul"] = achieved / rates["matmul_tflops"]
        result["grpo_step"] = step
    else:
        result["grpo_step"] = {"skipped": "time budget"}
    if budget.allow(f"[{name}] native generation", w.need_gen_s):
        print(f"[{name}] native generation ...", flush=True)
        if recipe is not None:
            model = recipe.model
        else:
            from torchtune.models.qwen2 import qwen2
            from torchtune.training import set_default_dtype

            from torchtune_grpo.policy.decoder import policy_decoder

            with set_default_dtype(_dtype(args.dtype)), torch.device(args.device):
                model = policy_decoder(qwen2(**dims))
        with torch.no_grad():
            result["generation"]["native"] = bench_native_generation(model, dims, w,
                                                                     args.device)
        del model
    else:
        result["generation"]["native"] = {"skipped": "time budget"}
    del recipe
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    return result


def _params(n: int | None) -> str:
    """A parameter count as ``494M`` / ``3.09B`` / ``0.20M``."""
    if n is None:
        return "-"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


def markdown_table(report: dict) -> str:
    """The results as a markdown table (one row per shape) plus a line on the device."""
    lines = [
        f"{report['device_name']}, torch {report['torch']}, {report['dtype']}; peak "
        f"{harness.fmt(report['peak_tflops'], '.0f')} TFLOP/s ({report['peak_tflops_source']}), "
        f"measured {report['matmul_size']}^3 matmul {report['matmul_tflops']:.1f} TFLOP/s. "
        "Step FLOPs: 6 N (prompt + response tokens trained) + 2 N (prefill + generated + "
        "reference tokens).",
        "",
        "| shape | params | workload | native tok/s | vLLM tok/s | step s (gen / score / ref / "
        "update) | MFU vs peak | MFU vs matmul | peak GiB | estimate GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["shapes"].items():
        w = r["workload"]
        native = r["generation"].get("native", {})
        vllm = r["generation"].get("vllm", {})
        step = r.get("grpo_step", {})
        vllm_tps = ("skipped" if "skipped" in vllm
                    else harness.fmt(vllm.get("tokens_per_second"), ".0f"))
        if "mean_seconds" in step:
            s = step["mean_seconds"]
            split = (f"{s['total']:.2f} ({s['generation']:.2f} / {s['scoring']:.2f} / "
                     f"{s['reference']:.2f} / {s['update']:.2f})")
        else:
            split = step.get("skipped", "-")
        mem = step.get("peak_memory_bytes")
        est = step.get("estimated_peak_bytes")
        lines.append(
            f"| {name} | {_params(r['params'])} | {w['prompts']} x {w['group']} x "
            f"{w['new_tokens']} | {harness.fmt(native.get('tokens_per_second'), '.0f')} | "
            f"{vllm_tps} | "
            f"{split} | {harness.fmt(step.get('mfu_vs_peak'), '.1%')} | "
            f"{harness.fmt(step.get('mfu_vs_matmul'), '.1%')} | "
            f"{harness.fmt(None if mem is None else mem / 2**30, '.2f')} | "
            f"{harness.fmt(None if est is None else est / 2**30, '.2f')} |")
    kinds = {r.get("grpo_step", {}).get("memory_kind") for r in report["shapes"].values()}
    if "peak_rss" in kinds:
        lines.append("\npeak GiB: the process's peak resident set size on CPU, not comparable "
                     "with the estimate (device memory)")
    for name, r in report["shapes"].items():
        vllm = r["generation"].get("vllm", {})
        if "skipped" in vllm:
            lines.append(f"\nvLLM ({name}): {vllm['skipped']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate the command line (errors name the bad value and the choices)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=(
        "Shapes: " + ", ".join(f"{k} ({BUILDERS[k]})" for k in SHAPES)
        + ". --tiny replaces them by one tiny shape (2 layers, dim 64, vocab 512)."))
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), metavar="SHAPE",
                        help=f"shapes to run, from {list(SHAPES)} (default: all)")
    parser.add_argument("--tiny", action="store_true",
                        help="one tiny shape and workload (the CPU test)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--time-budget", type=float, default=420.0,
                        help="seconds for the whole run; parts that would not fit are skipped "
                             "(default 420)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak dense bf16 TFLOP/s of the device for MFU (default: a table "
                             "by torch.cuda.get_device_name())")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if it imports")
    parser.add_argument("--vllm-cuda-graphs", action="store_true",
                        help="vLLM with CUDA graphs (default: enforce_eager, as the recipe's "
                             "VLLMGenerator)")
    parser.add_argument("--check-part", choices=list(CHECK_PARTS),
                        help="run one part of scripts/gpu_check.sh (its figures to --out)")
    parser.add_argument("--vllm-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(map(repr, unknown))}; choose from "
                     f"{', '.join(SHAPES)}")
    if args.time_budget <= 0:
        parser.error(f"--time-budget must be positive, got {args.time_budget:g}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        parser.error(f"--peak-tflops must be positive, got {args.peak_tflops:g}")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    args = parse_args(argv)
    if args.vllm_worker:
        w = TINY_WORKLOAD if args.tiny else WORKLOADS[args.worker_shape]
        vocab = (TINY if args.tiny else SHAPES[args.worker_shape])["vocab_size"]
        result = vllm_worker(args.vllm_worker, w, vocab, args.dtype, args.vllm_cuda_graphs)
        args.worker_out.write_text(json.dumps(result))
        return 0

    budget = Budget(args.time_budget)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False (use --device cpu "
              "--tiny for the CPU check)", file=sys.stderr)
        return 2
    if args.check_part:
        CHECK_PARTS[args.check_part](CheckPart(args.check_part, args))
        return 0
    cuda = torch.device(args.device).type == "cuda"
    device_name = torch.cuda.get_device_name(args.device) if cuda else (
        platform.processor() or platform.machine())
    peak, source = peak_tflops(args.device, args.peak_tflops)
    size = 8192 if cuda else 256
    rates = {"peak_tflops": peak, "matmul_tflops": matmul_tflops(args.device, args.dtype, size)}
    print(f"{device_name}: peak {harness.fmt(peak, '.0f')} TFLOP/s ({source}); {args.dtype} "
          f"{size}^3 matmul {rates['matmul_tflops']:.1f} TFLOP/s", flush=True)
    shapes = {"tiny": TINY} if args.tiny else {k: SHAPES[k] for k in args.shapes}
    report: dict = {
        "device": args.device, "device_name": device_name, "torch": torch.__version__,
        "dtype": args.dtype, "tiny": args.tiny, "time_budget_s": args.time_budget,
        "peak_tflops": peak, "peak_tflops_source": source, "matmul_size": size,
        "matmul_tflops": rates["matmul_tflops"], "shapes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name, dims in shapes.items():
            w = TINY_WORKLOAD if args.tiny else WORKLOADS[name]
            report["shapes"][name] = bench_shape(name, dims, w, args, budget, workdir, rates)
        for name, dims in shapes.items():  # vLLM last: each engine start-up is the slow part
            w = TINY_WORKLOAD if args.tiny else WORKLOADS[name]
            entry = report["shapes"][name]
            if args.no_vllm:
                entry["generation"]["vllm"] = {"skipped": "--no-vllm"}
            elif "model_dir" not in entry:
                entry["generation"]["vllm"] = {"skipped": "time budget (shape skipped)"}
            else:
                print(f"[{name}] vLLM generation ...", flush=True)
                entry["generation"]["vllm"] = bench_vllm(Path(entry["model_dir"]), name, w,
                                                         dims, args, budget)
            if "skipped" in entry["generation"]["vllm"]:
                print(f"[{name}] vLLM skipped: {entry['generation']['vllm']['skipped']}")
    report["skipped"] = budget.skipped
    report["elapsed_s"] = budget.elapsed()
    report["markdown"] = markdown_table(report)
    print("\n" + report["markdown"])
    print(f"\ntotal {report['elapsed_s']:.0f} s of the {args.time_budget:.0f} s budget")
    if args.out:
        harness.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
