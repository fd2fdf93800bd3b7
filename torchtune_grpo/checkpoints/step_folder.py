"""What a step folder must hold to be used, and the check that says what one lacks.

A step folder is complete on its own: weights, the *model files* beside them (``config.json``,
tokenizer files, chat template, generation config; read once from the base folder by
:func:`model_folder_files`), ``recipe_state.pt`` and the completion marker.
:func:`check_step_folder` (``tune-grpo check-step DIR``) says, without loading a weight,
whether a folder can be resumed, evaluated and loaded by transformers (resume decides with it;
the recipes' input-file check shares its parts);
:func:`check_model_folder` checks that a model folder fits the config's model.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from torchtune_grpo.errors import CheckpointError

#: The file of a step folder that holds what the next step reads (and the training config).
RECIPE_STATE_FILE = "recipe_state.pt"

#: Files of a step folder that are not model files: the step's own, and weight indexes.
NOT_MODEL_FILES = frozenset({"CHECKPOINT_COMPLETE", "recipe_state.pt", "eval_results.json",
                             "eval_samples.jsonl", "model.safetensors.index.json",
                             "pytorch_model.bin.index.json"})
#: Suffixes of weight and state files (never model files).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".msgpack", ".h5")
#: Tokenizer files; a folder that can be evaluated holds at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
#: The JSON files a tokenizer is read from (by ``tokenizers``, transformers' ``AutoTokenizer``,
#: torchtune's tokenizer builders, :class:`~torchtune_grpo.models.HFTokenizer`); each one a
#: folder holds must parse.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "vocab.json", "added_tokens.json", "chat_template.json")
#: Every JSON model file and the uses that read it (``generation_config.json``: the HF
#: tokenizer of ``grpo_eval``; transformers skips a damaged one).
JSON_MODEL_FILES: dict[str, tuple[str, ...]] = {
    "config.json": ("resume", "evaluate", "transformers"),
    **{name: ("evaluate", "transformers") for name in TOKENIZER_JSON_FILES},
    "generation_config.json": ("evaluate",),
}
#: Weight index files: each names the weight file of every tensor.
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: A model file larger than this is not carried into step folders (none of a model's
#: description is; a 262k-vocabulary ``tokenizer.json`` is about 33 MB).
MAX_MODEL_FILE_BYTES = 512 * 2**20


def model_folder_files(folder: str | Path, *, tokenizer_cfg: Any = None) -> dict[str, bytes]:
    """The model files of ``folder`` (its top level but weights, hidden files and a step's own
    files), plus the files the tokenizer config names, read into memory.

    Args:
        folder: the base model folder (``checkpointer.checkpoint_dir``).
        tokenizer_cfg: the config's ``tokenizer`` node; each string value naming an existing
            file is carried under its file name, over a file of that name in ``folder``.

    Returns:
        ``file name -> content``; empty when ``folder`` does not exist.
    """
    return {name: path.read_bytes()
            for name, path in model_folder_paths(folder, tokenizer_cfg=tokenizer_cfg).items()}


def model_folder_paths(folder: str | Path, *, tokenizer_cfg: Any = None) -> dict[str, Path]:
    """Where each file :func:`model_folder_files` reads comes from (``file name -> path``)."""
    paths: dict[str, Path] = {}
    root = Path(folder).expanduser()
    if str(folder) and root.is_dir():
        for item in sorted(root.iterdir()):
            if _is_model_file(item):
                paths[item.name] = item
    for value in _strings(tokenizer_cfg):
        path = Path(value).expanduser()
        if value and path.is_file() and path.stat().st_size <= MAX_MODEL_FILE_BYTES:
            paths[path.name] = path
    return paths


def _is_model_file(item: Path) -> bool:
    return (item.is_file() and not item.name.startswith(".")
            and item.name not in NOT_MODEL_FILES
            and not item.name.endswith(WEIGHT_SUFFIXES)
            and not item.name.endswith((".partial.jsonl", ".lock"))
            and item.stat().st_size <= MAX_MODEL_FILE_BYTES)


def _strings(node: Any) -> list[str]:
    if node is None:
        return []
    try:
        items = node.items()
    except AttributeError:
        return []
    return [str(v) for k, v in items if k != "_component_" and isinstance(v, str)]


def write_missing_files(folder: str | Path, files: dict[str, bytes]) -> list[str]:
    """Write each of ``files`` that ``folder`` lacks (never overwrites; each file atomically).

    Returns:
        The names written, sorted.
    """
    folder = Path(folder)
    written = []
    for name, data in sorted(files.items()):
        target = folder / name
        if target.exists():
            continue
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, target)
        written.append(name)
    return written


# ---------------------------------------------------------------------------- the check
def safetensors_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (from its header and size, no tensor loaded),
    or None, e.g. ``"truncated: 1,234 of 5,678 bytes"``.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated: {size:,} bytes, not even a header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                return (f"truncated or not a safetensors file: its header says {n:,} bytes of "
                        f"header, the file has {size:,}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"not a safetensors file ({exc})"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, IndexError, TypeError, ValueError):
            return f"corrupt header (tensor {name!r} has no data_offsets)"
    expected = 8 + n + end
    if size < expected:
        return f"truncated: {size:,} of {expected:,} bytes"
    return None


def recipe_state_problem(path: str | Path) -> str | None:
    """Why ``recipe_state.pt`` cannot be read (a truncated or foreign file), or None; reads
    the archive's directory only."""
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return "not a torch.save archive"
    except (OSError, zipfile.BadZipFile) as exc:
        return f"truncated or corrupt ({exc})"
    return None


def json_problem(path: str | Path) -> str | None:
    """Why the JSON file ``path`` does not parse (a full parse), or None, e.g. ``"not valid
    JSON (Unterminated string ...: line 1 column 901 (char 900)): truncated or damaged"``."""
    try:
        json.loads(Path(path).read_bytes())
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        return f"not valid JSON ({exc}): truncated or damaged"
    return None


def damaged_json_files(folder: str | Path, names: Any = None) -> dict[str, str]:
    """The JSON model files of ``folder`` (``names``, default :data:`JSON_MODEL_FILES`) that
    exist and do not parse: ``file name -> why``."""
    root = Path(folder)
    found = {}
    for name in names if names is not None else JSON_MODEL_FILES:
        if (root / name).is_file() and (why := json_problem(root / name)) is not None:
            found[name] = why
    return found


def index_problems(folder: str | Path) -> list[str]:
    """What the weight indexes of ``folder`` (:data:`WEIGHT_INDEXES`) say is wrong: an index
    that is not one, or each weight file it names that is missing, e.g.
    ``"model-00002-of-00002.safetensors is missing (named by model.safetensors.index.json)"``.
    """
    root = Path(folder)
    problems = []
    for index_name in WEIGHT_INDEXES:
        index = root / index_name
        if not index.is_file():
            continue
        try:
            names = set(json.loads(index.read_bytes())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            problems.append(f"{index_name} is not a weight index ({exc})")
            continue
        problems.extend(f"{name} is missing (named by {index_name})"
                        for name in sorted(map(str, names)) if not (root / name).is_file())
    return problems


@dataclass
class FolderReport:
    """What :func:`check_step_folder` found.

    Attributes:
        path: the folder.
        is_step: it has a completion marker (a step folder of a run).
        problems: what makes it unusable for ``use`` -> list of reasons, for each of
            ``"resume"``, ``"evaluate"`` and ``"transformers"``.
        notes: facts that are not problems (the step, evaluation results present).
        restored: the model files a resume writes into the folder from the base model folder
            (those it lacks; never one it holds), sorted.
        base_dir: the base model folder of the run that wrote the step (its saved config's
            ``checkpointer.checkpoint_dir``), None when unknown.
    """

    path: Path
    is_step: bool = False
    problems: dict[str, list[str]] = field(default_factory=lambda: {
        "resume": [], "evaluate": [], "transformers": []})
    notes: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    base_dir: Path | None = None

    def ok(self, use: str) -> bool:
        """Whether the folder serves ``use`` (``resume``, ``evaluate`` or ``transformers``)."""
        return not self.problems[use]

    def damaged(self) -> list[str]:
        """Every problem, once each, in the order found."""
        seen: list[str] = []
        for reasons in self.problems.values():
            seen.extend(r for r in reasons if r not in seen)
        return seen

    def lines(self) -> list[str]:
        """The report as printed by ``tune-grpo check-step``."""
        out = [f"{self.path}: {'step folder' if self.is_step else 'model folder'}"
               + (f" ({', '.join(self.notes)})" if self.notes else "")]
        for use in ("resume", "evaluate", "transformers"):
            if use == "resume" and not self.is_step:
                continue
            what = {"resume": "resume_from_checkpoint", "evaluate": "tune run grpo_eval",
                    "transformers": "transformers / vLLM"}[use]
            reasons = self.problems[use]
            verdict = "ok" if not reasons else "no: " + "; ".join(reasons)
            if use == "resume" and not reasons and self.restored:
                verdict += (f" ({_and(self.restored)} "
                            f"{'is' if len(self.restored) == 1 else 'are'} restored from the "
                            f"base model folder {self.base_dir})")
            out.append(f"  {what}: {verdict}")
        return out


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_step_folder(path: str | Path) -> FolderReport:
    """Check a step folder (or a model folder) without loading a weight; the verdicts are what
    resume (:func:`~torchtune_grpo.checkpoints.saving.resolve_resume` uses the ``"resume"``
    one), ``grpo_eval`` and transformers then do.

    Looks for the completion marker and ``recipe_state.pt`` (resume), ``config.json`` (every
    use), a tokenizer file (evaluation), parses every JSON model file (:data:`JSON_MODEL_FILES`:
    ``config.json``, the tokenizer's, the generation config), and checks the weight files (each
    one an index names present, each safetensors file whole). A file a step lacks that the
    base model folder (named in the step's saved config) holds is no problem for resume: the
    recipe restores it (:func:`write_missing_files`) and it is listed in ``restored``. An
    adapters-only LoRA folder is resumable, not loadable alone.

    Args:
        path: the folder.

    Returns:
        A :class:`FolderReport`.
    """
    root = Path(path).expanduser()
    report = FolderReport(path=root)
    every = ("resume", "evaluate", "transformers")

    def problem(reason: str, *uses: str) -> None:
        for use in uses or every:
            report.problems[use].append(reason)

    if not root.is_dir():
        problem("the folder does not exist")
        return report
    report.is_step = (root / "CHECKPOINT_COMPLETE").is_file()
    if report.is_step:
        report.notes.append(f"step {(root / 'CHECKPOINT_COMPLETE').read_text().strip()}")
    elif root.name.startswith("step_"):
        problem("no CHECKPOINT_COMPLETE marker (an unfinished save)", "resume")
    if (root / "eval_results.json").is_file():
        report.notes.append("evaluated")
    state = root / "recipe_state.pt"
    saved = None
    if report.is_step:
        if not state.is_file():
            problem("no recipe_state.pt", "resume")
        elif (why := recipe_state_problem(state)) is not None:
            problem(f"recipe_state.pt is {why}", "resume")
        else:
            saved = _saved_config(state)
    report.base_dir, report.restored = _restorable(root, saved)
    # the step's files a resume reads: config.json (the checkpointer), and the tokenizer's when
    # the saved config reads it from the step itself
    resume_reads = {"config.json", *_read_from(root, saved.get("tokenizer") if saved else None)}
    if not (root / "config.json").is_file():
        problem("no config.json", "evaluate", "transformers")
    for name in sorted(resume_reads - set(report.restored)):
        if not (root / name).is_file():
            problem(f"no {name}" + ("" if report.base_dir is None else " (nor an intact one in "
                                    f"the base model folder {report.base_dir})"), "resume")
    for name, why in damaged_json_files(root).items():
        uses = JSON_MODEL_FILES[name]
        problem(f"{name} is {why}", *dict.fromkeys(
            [*uses, *(["resume"] if name in resume_reads else [])]))
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        problem("no tokenizer file (" + ", ".join(TOKENIZER_FILES) + ")", "evaluate",
                "transformers")
    _check_weights(root, problem)
    return report


def _saved_config(state: Path) -> dict[str, Any] | None:
    """The resolved config saved in ``recipe_state.pt`` (memory-mapped), or None."""
    import torch

    try:
        config = torch.load(state, map_location="cpu", weights_only=True, mmap=True).get("config")
    except Exception:  # noqa: BLE001  (a damaged file is reported by recipe_state_problem)
        return None
    return config if isinstance(config, dict) else None


def _restorable(root: Path, saved: dict[str, Any] | None) -> tuple[Path | None, list[str]]:
    """``(base model folder, the model files of it that root lacks)`` as a resume restores them
    (JSON ones only when they parse); ``(None, [])`` without a saved config naming the folder."""
    checkpointer = (saved or {}).get("checkpointer")
    if not isinstance(checkpointer, dict) or not checkpointer.get("checkpoint_dir"):
        return None, []
    base = Path(str(checkpointer["checkpoint_dir"])).expanduser()
    files = model_folder_paths(base, tokenizer_cfg=(saved or {}).get("tokenizer"))
    return base, sorted(name for name, path in files.items() if not (root / name).exists()
                        and (name not in JSON_MODEL_FILES or json_problem(path) is None))


def _read_from(root: Path, tokenizer_cfg: Any) -> set[str]:
    """The files of ``root`` a tokenizer config reads: each path value inside ``root`` (a folder
    value: its tokenizer JSON files)."""
    names: set[str] = set()
    where = root.resolve()
    for value in _strings(tokenizer_cfg):
        path = Path(value).expanduser().resolve() if value else None
        if path == where:
            names.update(TOKENIZER_JSON_FILES)
        elif path is not None and path.parent == where:
            names.add(path.name)
    return names


def _check_weights(root: Path, problem: Any) -> None:
    adapters = [p for p in root.glob("adapter_model.*") if p.suffix in (".safetensors", ".bin",
                                                                        ".pt")]
    weights = sorted(p for p in root.glob("*.safetensors") if not p.name.startswith("adapter"))
    bins = sorted(p for p in [*root.glob("*.bin"), *root.glob("*.pt")]  # torch-format weights
                  if not p.name.startswith("adapter") and p.name != "recipe_state.pt")
    for reason in index_problems(root):
        problem(reason)
    for path in weights + adapters:
        if path.suffix == ".safetensors" and (why := safetensors_problem(path)) is not None:
            problem(f"{path.name} is {why}")
    if not weights and not bins:
        if adapters:
            problem("adapter weights only (save_adapter_weights_only): load the base model "
                    "with the adapters", "evaluate", "transformers")
        else:
            problem("no weight file (*.safetensors, *.bin or *.pt)")


# ---------------------------------------------------------------------------- the model folder
#: torchtune checkpointer ``model_type`` values whose weight converter fits each HF
#: architecture (``config.json``'s ``architectures[0]``).
_MODEL_TYPES_OF = {
    "LlamaForCausalLM": {"LLAMA2", "LLAMA3", "LLAMA3_2"},
    "Qwen2ForCausalLM": {"QWEN2"},
    "MistralForCausalLM": {"MISTRAL"},
    "GemmaForCausalLM": {"GEMMA"},
    "Gemma2ForCausalLM": {"GEMMA2"},
    "Phi3ForCausalLM": {"PHI3_MINI", "PHI4"},
}
#: Builders that read the folder's ``config.json`` themselves: nothing to cross-check.
_READS_THE_FOLDER = ("torchtune_grpo.models.hf_model", "torchtune_grpo.models.lora_hf_model",
                     "torchtune_grpo.models.builders.hf_model",
                     "torchtune_grpo.models.builders.lora_hf_model")


def check_model_folder(cfg: DictConfig, model: Any, folder: str | Path | None = None) -> None:
    """Before any weight loads: the model folder's ``config.json`` describes the model the config
    builds (architecture, vocabulary, width, depth, heads).

    Args:
        cfg: the merged config (``model``, ``checkpointer``).
        model: the config's model built on the meta device (its shape).
        folder: the folder holding the weights (default ``checkpointer.checkpoint_dir``).

    Raises:
        CheckpointError: naming the folder, what its ``config.json`` says and the config keys.
    """
    folder = Path(str(folder or cfg.checkpointer.get("checkpoint_dir") or "")).expanduser()
    component = str(cfg.model.get("_component_", ""))
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # no config.json: not an HF folder; the checkpointer says what it needs
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    if component in _READS_THE_FOLDER:
        return
    model_type = str(cfg.checkpointer.get("model_type") or "")
    builds = f"{component} (model._component_" + (
        f", checkpointer.model_type={model_type})" if model_type else ")")
    fitting = _MODEL_TYPES_OF.get(arch)
    if model_type and (fitting is None or model_type not in fitting):
        raise CheckpointError(
            f"model folder {folder} holds a {arch} (config.json), but the config builds "
            f"{builds}; use model._component_=torchtune_grpo.models.hf_model with "
            f"model.model_dir={folder} (it reads the folder), or point checkpointer at a "
            f"folder of the configured model")
    found = _model_dims(model)
    wanted = {"vocab_size": hf.get("vocab_size"), "hidden_size": hf.get("hidden_size"),
              "num_hidden_layers": hf.get("num_hidden_layers"),
              "num_attention_heads": hf.get("num_attention_heads"),
              "num_key_value_heads": hf.get("num_key_value_heads",
                                            hf.get("num_attention_heads"))}
    differ = [f"{key} {wanted[key]} (config.json) vs {found[key]}"
              for key in wanted if wanted[key] is not None and found.get(key) is not None
              and int(wanted[key]) != int(found[key])]
    if differ:
        raise CheckpointError(
            f"model folder {folder} ({arch}) does not match the model the config builds, "
            f"{builds}: " + ", ".join(differ) + "; fix the `model` block or the folder, or "
            f"use model._component_=torchtune_grpo.models.hf_model with model.model_dir={folder} "
            "(it reads the folder's shape)")


def _model_dims(model: Any) -> dict[str, int | None]:
    """Vocabulary, width, depth and head counts of a torchtune decoder (meta device is fine)."""
    layers = getattr(model, "layers", None)
    attn = getattr(layers[0], "attn", None) if layers else None
    emb = getattr(model, "tok_embeddings", None)
    return {"vocab_size": getattr(emb, "num_embeddings", None),
            "hidden_size": getattr(emb, "embedding_dim", None),
            "num_hidden_layers": len(layers) if layers is not None else None,
            "num_attention_heads": getattr(attn, "num_heads", None),
            "num_key_value_heads": getattr(attn, "num_kv_heads", None)}


#: Keys of a training config that make its evaluation multi-turn (see
#: :func:`tool_settings_from_checkpoint`).
TOOL_KEYS = ("tools", "max_tool_calls", "tool_syntax")


def tool_settings_from_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The ``tools``, ``max_tool_calls`` and ``tool_syntax`` a step folder was trained with, from
    the config in its ``recipe_state.pt`` (memory-mapped).

    Args:
        checkpoint_dir: a ``step_{N}`` folder.

    Returns:
        The keys the training config had; ``{"tools": None}`` without tools or without the file.
    """
    import torch
    from omegaconf import OmegaConf

    path = Path(str(checkpoint_dir)) / RECIPE_STATE_FILE
    if not path.is_file():
        return {"tools": None}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    config = state.get("config") or {}
    found = {k: config[k] for k in TOOL_KEYS if config.get(k) is not None}
    found.setdefault("tools", None)
    return {k: (OmegaConf.create(v) if isinstance(v, (list, dict)) else v)
            for k, v in found.items()}
