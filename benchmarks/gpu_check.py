"""The GPU check: everything the lent GPU machine should run, in one call of at most 8 minutes.

``bash scripts/gpu_check.sh`` puts the device kit (``scripts/device_kit.sh``), the repository
and ``recipes/`` on ``PYTHONPATH`` and runs this driver. It imports only the standard library:
every part runs in its own process, under a hard timeout, with its output in a log file under
``--out`` (default ``$OUT``), so a part that fails or hangs costs its own slot and no more.

Parts, in order (the risky ones first, so that a cut run has measured them):

1. **preflight** (``--preflight-child``, a subprocess): imports torch, torchao, torchtune (and its
   ``tune`` CLI), omegaconf, this package's recipe and ``benchmarks.gpu``; checks the device
   (``torch.cuda.is_available()``, a bf16 matmul on it). On failure it prints *one line*,
   ``error: ...``, naming what is wrong and what to do, and the check exits 2.
2. **optimizer** .. **fsdp_gather** (:data:`PARTS`): each but two a ``benchmarks/gpu.py
   --check-part NAME`` process (the code and what each measures: ``benchmarks.gpu.check_*``) whose
   figures go to ``NAME.json`` as they come: the bf16 optimizers' first and later steps on a
   one-rank FSDP2 layer of the 3B shape; decode ms and host syncs per token at 16 and 64 rows;
   GRPO steps of ``grpo/qwen2_5_3B_full``'s settings at its shape (time per phase, peak memory
   against the estimate) and, from them, the bf16 engine-trainer log-prob gap; then the
   **quickstart**: ``prepare-quickstart`` (the tiny model, written on CPU) and
   ``tune run grpo_full_finetune_distributed --config grpo/quickstart_cpu device=<device>
   dtype=<dtype> num_steps=20`` with held-out greedy accuracy before and after; last a
   one-rank NCCL FSDP2 decode through ``gathered_for_inference``.

Time guards: the whole check has ``--budget`` seconds (default 450, so that it ends within 8
minutes with start-up to spare). A part starts only when the rest of the budget covers what it
needs (``NEED_S``), else it is skipped, named, with the seconds left; each runs under a hard
timeout of ``MAX_S`` or the budget's rest, whichever is shorter; ``--skip`` leaves parts out.
``summary.json`` and ``summary.txt`` under ``--out`` list every part (ran / skipped / failed,
seconds, the reason or the result). Exit status: 0 when no part failed (skips included), 1 when
one failed, 2 when the preflight failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where ``scripts/device_kit.sh`` unpacks the kit by default.
KIT = REPO / ".device_kit" / "site-packages"
#: Seconds each part needs at least to be started (time guards), by device kind.
NEED_S = {
    "cuda": {"optimizer": 60.0, "decode": 60.0, "grpo_step": 120.0, "quickstart": 150.0,
             "fsdp_gather": 30.0},
    "cpu": {"optimizer": 40.0, "decode": 20.0, "grpo_step": 20.0, "quickstart": 150.0,
            "fsdp_gather": 20.0},
}
#: The most seconds each ``benchmarks/gpu.py`` part may run (a hang costs this, not the rest).
MAX_S = {"optimizer": 150.0, "decode": 150.0, "grpo_step": 240.0, "fsdp_gather": 90.0}
#: The parts after the preflight, in the order they run: the quickstart here, the log-prob
#: gap read from ``grpo_step.json``, the others by ``benchmarks/gpu.py --check-part NAME``.
PARTS = ("optimizer", "decode", "grpo_step", "logprob_gap", "quickstart", "fsdp_gather")
#: Seconds kept back at the end of the budget for the summary.
RESERVE_S = 10.0
QUICKSTART_STEPS = 20
#: Modules the preflight imports: the recipe's whole import graph and the benchmark's.
PREFLIGHT_IMPORTS = ("torch", "torchao", "omegaconf", "torchtune", "torchtune._cli.tune",
                     "torchtune_grpo.training.recipe", "grpo_full_finetune_distributed",
                     "benchmarks.gpu")


@dataclass
class Part:
    """One part of the check and what became of it.

    Attributes:
        name: the part's name (``preflight``, ``gpu_benchmark``, ``quickstart``, ``fsdp2``).
        status: ``ran``, ``skipped`` or ``failed``.
        seconds: wall seconds it took (0 when skipped).
        detail: the reason it was skipped or failed, or its result in one line.
        log: its log file, relative to ``--out``, when it ran.
    """

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    log: str | None = None


@dataclass
class Clock:
    """The check's time budget: :meth:`left` seconds, :meth:`allow` as a time guard."""

    budget: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds of the budget still left."""
        return self.budget - (time.monotonic() - self.start)

    def allow(self, need: float) -> bool:
        """Whether a part that needs ``need`` seconds still fits (``RESERVE_S`` kept back)."""
        return self.left() - RESERVE_S >= need

    def skip_reason(self, need: float) -> str:
        """Why a part that needs ``need`` seconds does not fit."""
        return (f"time guard: {max(self.left(), 0.0):.0f} s of the {self.budget:.0f} s budget "
                f"left, the part needs ~{need:.0f} s")


# ---------------------------------------------------------------------------- subprocesses
def child_env(device: str) -> dict[str, str]:
    """The environment of every part: unbuffered, offline (the lent machine reaches no hub)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.setdefault(key, "1")
    if device == "cpu":
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str],
               cwd: Path = REPO) -> tuple[int | None, float]:
    """Run ``cmd`` with stdout and stderr into ``log``; kill its process group at ``timeout``.

    Returns:
        ``(exit status or None when it was killed at the timeout, wall seconds)``.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as handle:
        handle.write("$ " + " ".join(cmd) + "\n")
        handle.flush()
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    return code, time.monotonic() - t0


def tail(log: Path, lines: int) -> str:
    """The last ``lines`` lines of ``log`` without torchao's version notice (it says nothing
    about this check: the kit's torchao is the pure-Python build)."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    kept = [t for t in text if not t.startswith("Skipping import of cpp extensions")]
    return "\n".join(kept[-lines:])


def last_error(log: Path) -> str:
    """The last non-empty line of ``log`` (a failed part's error, usually)."""
    for line in reversed(tail(log, 400).splitlines()):
        if line.strip():
            return line.strip()[:300]
    return "(no output)"


# ---------------------------------------------------------------------------- preflight
def preflight_child(device: str, kit: Path) -> int:
    """In the preflight subprocess: import everything, check the device, print one line.

    Prints ``preflight: ok ...`` and a JSON line, or ``error: ...`` (one line) and returns 2.
    """
    import importlib

    manifest = kit.parent / "MANIFEST.txt"
    kit_python = None
    if manifest.is_file():
        first = manifest.read_text().splitlines()[0]
        kit_python = first.split("Python ")[1].split(":")[0] if "Python " in first else None
    here = "%d.%d" % sys.version_info[:2]
    for name in PREFLIGHT_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported in one line
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
            if not kit.is_dir():
                hint = (f"no device kit at {kit}: run `bash scripts/device_kit.sh` where a "
                        "package index is reachable and carry .device_kit/")
            elif kit_python and kit_python != here:
                hint = (f"the kit is for Python {kit_python} but this is Python {here}: rebuild "
                        f"it with `bash scripts/device_kit.sh --python-version {here}`")
            else:
                hint = f"the device kit at {kit} lacks it or does not fit this Python/torch"
            print(f"error: cannot import {name} ({why}); {hint}", flush=True)
            return 2
    import torch
    import torchao
    import torchtune

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "torchtune": torchtune.__version__,
            "torchao": torchao.__version__, "kit_python": kit_python, "device": device}
    if device == "cuda":
        if not torch.cuda.is_available():
            build = (f"CUDA {torch.version.cuda} build" if torch.version.cuda
                     else "a CPU-only build")
            print(f"error: no CUDA device: torch {torch.__version__} ({build}) reports "
                  "torch.cuda.is_available() False (driver, CUDA_VISIBLE_DEVICES?); for the CPU "
                  "check run `bash scripts/gpu_check.sh --device cpu --tiny`", flush=True)
            return 2
        try:
            a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
            float((a @ a).float().sum().cpu())
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"error: a bf16 matmul on the CUDA device failed ({type(exc).__name__}: "
                  f"{str(exc).strip().splitlines()[0][:200]})", flush=True)
            return 2
        props = torch.cuda.get_device_properties(0)
        info.update(gpus=torch.cuda.device_count(), gpu=props.name,
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}",
                    bf16=torch.cuda.is_bf16_supported())
        where = (f"{info['gpus']} x {props.name} ({info['gpu_memory_gib']} GiB, "
                 f"sm {info['capability']})")
    else:
        info["gpus"] = 0
        where = "CPU"
    print(f"preflight: ok: Python {info['python']}, torch {info['torch']}, torchtune "
          f"{info['torchtune']}, torchao {info['torchao']} (kit for Python {kit_python}); "
          f"{where}", flush=True)
    print("PREFLIGHT_JSON " + json.dumps(info), flush=True)
    return 0


def preflight(args: argparse.Namespace, clock: Clock, env: dict[str, str]
              ) -> tuple[Part, dict | None]:
    """Run :func:`preflight_child` in a subprocess; returns the part and the device info."""
    log = args.out / "preflight.log"
    cmd = [args.python, str(Path(__file__).resolve()), "--preflight-child", "--device",
           args.device, "--kit", str(args.kit)]
    code, seconds = run_logged(cmd, log, min(120.0, clock.left()), env)
    text = log.read_text(errors="replace")
    info = None
    for line in text.splitlines():
        if line.startswith("PREFLIGHT_JSON "):
            info = json.loads(line[len("PREFLIGHT_JSON "):])
    if code == 0 and info is not None:
        ok = next(x for x in text.splitlines() if x.startswith("preflight: ok"))
        return Part("preflight", "ran", seconds, ok[len("preflight: ok: "):],
                    log.name), info
    errors = [x for x in text.splitlines() if x.startswith("error: ")]
    if code is None:
        line = f"error: the preflight did not finish within {seconds:.0f} s"
    elif errors:
        line = errors[-1]
    else:
        line = f"error: the preflight exited {code}: {last_error(log)}"
    return Part("preflight", "failed", seconds, line, log.name), None


# ---------------------------------------------------------------------------- parts
def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def describe(name: str, figures: dict) -> str:
    """One line of a child part's figures (``NAME.json``) for the summary."""
    if name == "optimizer":
        rows = []
        for opt, row in figures.get("optimizers", {}).items():
            rows.append(f"{opt} {row['first_step_s']:.1f} s first step, {row['step_ms']:.1f} "
                        "ms/step" if row.get("status") == "ran" else
                        f"{opt} FAILED ({row.get('error', '?')[:220]})")
        return (f"{_params(figures.get('params', 0))} params over {figures.get('backend')}"
                f" FSDP2: " + "; ".join(rows))
    if name == "decode":
        rows = [f"{key.replace('_', ' ', 1)} rows {row['ms_per_token']:.1f} ms/token"
                + (f", {row['syncs_per_token']:.2f} syncs/token"
                   if row.get("syncs_per_token") is not None else "")
                + (f", {row['cuda_sync_warnings_per_token']:.2f} sync warnings/token"
                   if row.get("cuda_sync_warnings_per_token") is not None else "")
                if "ms_per_token" in row else f"{key} FAILED ({row.get('error', '?')[:120]})"
                for key, row in figures.get("rows", {}).items()]
        return (f"stop_check_interval {figures.get('stop_check_interval')}: " + "; ".join(rows)
                + (f"; compiled {figures['compiled']}" if "compiled" in figures else ""))
    if name == "grpo_step":
        steps = figures.get("steps", [])
        head = (f"{figures.get('config')} at {_params(figures.get('params', 0))} params, "
                f"{figures.get('batch_size')} x {figures.get('group_size')} x "
                f"{figures.get('max_generated_tokens')}")
        if not steps:
            return head + ": no step finished"
        last = steps[-1]
        phases = " / ".join(f"{k[5:]} {v:.1f}" for k, v in last.items()
                            if k.startswith("time/") and v >= 0.05)
        peak = ("peak" if figures.get("device") == "cuda" else
                "peak RSS (not the device memory the estimate is of)")
        return (f"{head}: step {len(steps)} {phases} s; {peak} "
                f"{_gib(last['peak_memory_bytes'])} vs estimate "
                f"{_gib(figures.get('estimated_peak_bytes'))}")
    if name == "fsdp_gather":
        seconds = figures.get("decode_seconds", {})
        return (f"{figures.get('backend')}: tokens equal to unsharded "
                f"{figures.get('tokens_equal')}, decode {seconds.get('gathered_once', 0):.2f} s"
                f" gathered once vs {seconds.get('per_forward', 0):.2f} s per forward")
    return ""


def part_child(name: str, args: argparse.Namespace, clock: Clock, env: dict[str, str],
               kind: str) -> Part:
    """``benchmarks/gpu.py --check-part NAME``: its figures in ``NAME.json``, its output in
    ``NAME.log``; killed after ``MAX_S`` (what it measured by then stays in its JSON)."""
    need = NEED_S[kind][name]
    if not clock.allow(need):
        return Part(name, "skipped", detail=clock.skip_reason(need))
    out, log = args.out / f"{name}.json", args.out / f"{name}.log"
    cmd = [args.python, str(REPO / "benchmarks" / "gpu.py"), "--check-part", name, "--device",
           args.device, "--dtype", args.dtype, "--out", str(out), *(["--tiny"] * args.tiny)]
    code, seconds = run_logged(cmd, log, min(MAX_S[name], clock.left() - RESERVE_S), env)
    print(tail(log, 12), flush=True)
    figures = json.loads(out.read_text()) if out.is_file() else {}
    detail = describe(name, figures)
    if code != 0:
        why = (f"killed after {seconds:.0f} s" if code is None
               else f"exit {code}: {last_error(log)}")
        return Part(name, "failed", seconds, why + (f"; measured: {detail}" if figures else ""),
                    log.name)
    return Part(name, "ran", seconds, detail + f"; {out.name}", log.name)


def part_logprob_gap(args: argparse.Namespace) -> Part:
    """The bf16 engine-trainer log-prob gap of the GRPO steps (``grpo_step.json``): max and
    mean per response token, first epoch, the same weights."""
    path = args.out / "grpo_step.json"
    steps = json.loads(path.read_text()).get("steps", []) if path.is_file() else []
    gaps = [(s["generation/logprob_diff_max"], s["generation/logprob_diff_mean"])
            for s in steps if "generation/logprob_diff_max" in s]
    if not gaps:
        return Part("logprob_gap", "skipped", detail="no GRPO step finished (grpo_step)")
    return Part("logprob_gap", "ran", detail=(
        f"{args.dtype} decode vs the training forward, per response token: "
        + "; ".join(f"step {i + 1} max {m:.3g}, mean {a:.3g}" for i, (m, a) in enumerate(gaps))
        + " (random weights; grpo_step.json)"))


def read_metric_log(log_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, metrics)`` rows of torchtune's ``DiskLogger`` files (``Step N | k:v k:v``)."""
    rows = []
    for path in sorted(log_dir.glob("*.txt")):
        for line in path.read_text().splitlines():
            head, sep, rest = line.partition(" | ")
            if not sep or not head.startswith("Step "):
                continue
            metrics = {}
            for item in rest.split():
                key, _, value = item.rpartition(":")
                try:
                    metrics[key] = float(value)
                except ValueError:
                    continue
            rows.append((int(head[5:]), metrics))
    return rows


def heldout_accuracy(run_dir: Path) -> tuple[float | None, float | None]:
    """``eval/pass@1`` before the first step and at the last evaluation of a run."""
    evals = [(s, m["eval/pass@1"]) for s, m in read_metric_log(run_dir / "logs")
             if "eval/pass@1" in m]
    if not evals:
        return None, None
    return evals[0][1], evals[-1][1]


def quickstart_overrides(device: str, dtype: str, model_dir: Path, run_dir: Path,
                         steps: int) -> list[str]:
    """The ``key=value`` overrides of ``grpo/quickstart_cpu`` for this check."""
    return [f"device={device}", f"dtype={dtype}", f"num_steps={steps}",
            f"eval_every_n_steps={steps}", f"model_dir={model_dir}", f"output_dir={run_dir}",
            "progress_bar=false"]


def part_quickstart(args: argparse.Namespace, clock: Clock, env: dict[str, str],
                    kind: str) -> Part:
    """Write the quickstart model, train it 20 steps on the device, held-out before/after."""
    need = NEED_S[kind]["quickstart"]
    if not clock.allow(need):
        return Part("quickstart", "skipped", detail=clock.skip_reason(need))
    base, run_dir = args.out / "quickstart" / "base", args.out / "quickstart" / "run"
    log = args.out / "quickstart.log"
    prepare_log = args.out / "prepare_quickstart.log"
    cmd = [args.python, "-m", "torchtune_grpo.cli.main", "prepare-quickstart", "--output-dir",
           str(base)]
    code, prep_s = run_logged(cmd, prepare_log, clock.left() - RESERVE_S, env)
    print(tail(prepare_log, 3), flush=True)
    if code != 0:
        why = "killed at its timeout" if code is None else f"exit {code}"
        return Part("quickstart", "failed", prep_s,
                    f"prepare-quickstart {why}: {last_error(prepare_log)}", prepare_log.name)
    cmd = [args.python, "-m", "torchtune._cli.tune", "run", "grpo_full_finetune_distributed",
           "--config", "grpo/quickstart_cpu",
           *quickstart_overrides(args.device, args.dtype, base, run_dir, QUICKSTART_STEPS)]
    code, seconds = run_logged(cmd, log, clock.left() - RESERVE_S, env)
    print(tail(log, 8), flush=True)
    seconds += prep_s
    if code != 0:
        why = "killed at its timeout" if code is None else f"exit {code}: {last_error(log)}"
        return Part("quickstart", "failed", seconds, why, log.name)
    before, after = heldout_accuracy(run_dir)
    if before is None:
        return Part("quickstart", "failed", seconds, "no eval/pass@1 in the metric log",
                    log.name)
    return Part("quickstart", "ran", seconds,
                f"{QUICKSTART_STEPS} steps, {args.device}, {args.dtype}: held-out greedy "
                f"accuracy {before:.3f} -> {after:.3f} (prepare {prep_s:.0f} s)", log.name)


# ---------------------------------------------------------------------------- driver
def summarize(parts: list[Part], args: argparse.Namespace, clock: Clock,
              info: dict | None) -> str:
    """Write ``summary.json`` and ``summary.txt`` under ``--out``; return the text."""
    elapsed = clock.budget - clock.left()
    lines = [f"GPU check ({args.device}{', tiny' if args.tiny else ''}): {elapsed:.0f} s of the "
             f"{clock.budget:.0f} s budget; results in {args.out}"]
    for p in parts:
        took = f" ({p.seconds:.0f} s)" if p.status != "skipped" else ""
        lines.append(f"  {p.name:<14} {p.status.upper():<8}{took} {p.detail}")
    text = "\n".join(lines)
    (args.out / "summary.txt").write_text(text + "\n")
    payload = {"device": args.device, "tiny": args.tiny, "budget_s": clock.budget,
               "elapsed_s": elapsed, "environment": info,
               "parts": [asdict(p) for p in parts]}
    (args.out / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", description=__doc__.split("\n")[0],
        epilog="Documented in docs/performance.md, section 'The GPU check'.")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (default: the lent machine) or cpu (with --tiny)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny shape instead of Qwen2.5-3B's (the CPU check)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for every result and log (default $OUT, else "
                             "outputs/gpu_check in the repository)")
    parser.add_argument("--budget", type=float, default=450.0,
                        help="seconds for the whole check (default 450: ends within 8 min)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                        help="the dtype of every part (default bf16, on CPU as well: the "
                             "same code path as on the GPU)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter of every part (default: this one)")
    parser.add_argument("--kit", type=Path, default=Path(os.environ.get("DEVICE_KIT", KIT)),
                        help="the kit's site-packages (default .device_kit/site-packages)")
    parser.add_argument("--skip", nargs="+", default=[], metavar="PART", choices=PARTS,
                        help=f"parts not to run, from {', '.join(PARTS)}")
    parser.add_argument("--preflight-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.tiny and not args.preflight_child:
        parser.error("--device cpu runs only the tiny shape: add --tiny")
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget:g}")
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else (
            REPO / "outputs" / "gpu_check")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module docstring); returns the exit status."""
    args = parse_args(argv)
    if args.preflight_child:
        return preflight_child(args.device, args.kit)
    clock = Clock(args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.device)
    part, info = preflight(args, clock, env)
    parts = [part]
    if info is None:
        print(part.detail, flush=True)
        summarize(parts, args, clock, info)
        return 2
    print(f"preflight: {part.detail}", flush=True)
    kind = args.device
    for name in PARTS:
        print(f"--- {name} ({clock.left():.0f} s left)", flush=True)
        if name in args.skip:
            parts.append(Part(name, "skipped", detail="--skip"))
        elif name == "logprob_gap":
            parts.append(part_logprob_gap(args))
        elif name == "quickstart":
            parts.append(part_quickstart(args, clock, env, kind))
        else:
            parts.append(part_child(name, args, clock, env, kind))
        print(f"{name}: {parts[-1].status}: {parts[-1].detail}", flush=True)
    print("\n" + summarize(parts, args, clock, info), flush=True)
    return 1 if any(p.status == "failed" for p in parts) else 0


if __name__ == "__main__":
    sys.exit(main())
