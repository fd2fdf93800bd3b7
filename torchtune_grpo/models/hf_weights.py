"""HF <-> torchtune weight names of the families this package builds, and the checkpointer of
their HF folders.

Each family gives a :class:`WeightNames` table; :class:`HFFamilyCheckpointer` writes the files
``FullModelHFCheckpointer`` writes (shards, index, PEFT adapter, config and tokenizer files),
tensors unchanged. :class:`Fused` entries split one HF tensor into torchtune's separate
projections on load and stack them on save; their LoRA adapters become one PEFT adapter per
fused module (``A`` stacked, ``B`` block-diagonal), except DoRA on some parts only, which has
no PEFT form.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchtune_grpo.models.families import MODEL_TYPES

__all__ = ["FamilyModelType", "Fused", "HFFamilyCheckpointer", "WeightNames"]

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TUNE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PEFT_PARTS = ((".lora_a.weight", ".lora_A.weight"), (".lora_b.weight", ".lora_B.weight"),
               (".magnitude", ".lora_magnitude_vector"))


#: The checkpointers' model types (torchtune's ``ModelType`` has none of these), one per entry
#: of :data:`~torchtune_grpo.models.families.MODEL_TYPES` (``FamilyModelType.QWEN3.value ==
#: "qwen3"``); ``.name`` is what :class:`~torchtune_grpo.rollout.protocol.GenerationContext`
#: carries.
FamilyModelType = enum.Enum(  # type: ignore[misc]
    "FamilyModelType", {kind: kind.lower() for kind in MODEL_TYPES.values()})


@dataclass(frozen=True)
class Fused:
    """One HF layer tensor that is several torchtune tensors stacked along its rows.

    Attributes:
        parts: the torchtune suffixes after ``layers.{i}.``, in the HF rows' order
            (``("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight")``).
        rows: ``config.json`` -> the row count of each part.
    """

    parts: tuple[str, ...]
    rows: Callable[[dict[str, Any]], tuple[int, ...]]


def _module(suffix: str) -> str:
    """``"self_attn.qkv_proj.weight"`` -> ``"qkv_proj"``."""
    return suffix.rsplit(".", 2)[-2]


@dataclass(frozen=True)
class WeightNames:
    """A family's HF weight names and their torchtune names.

    Attributes:
        family: the family, for messages (``"Qwen3"``).
        model_type: its :class:`FamilyModelType` name (``"QWEN3"``).
        global_names: HF name -> torchtune name outside the layers.
        layer_names: suffix after ``model.layers.{i}.`` -> suffix after ``layers.{i}.``.
        tied_by_default: ``tie_word_embeddings`` when ``config.json`` does not say.
        not_part: how a foreign weight is described (``"part of a dense Qwen3ForCausalLM
            (no biases, no experts)"``).
        fused: HF layer suffix -> its :class:`Fused` parts (none: every name maps one to one).
    """

    family: str
    model_type: str
    global_names: dict[str, str]
    layer_names: dict[str, str]
    tied_by_default: bool
    not_part: str
    fused: dict[str, Fused] = field(default_factory=dict)
    _to_hf_layer: dict[str, str] = field(init=False, repr=False)
    _to_hf_global: dict[str, str] = field(init=False, repr=False)
    _part_of: dict[str, tuple[str, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_to_hf_layer", {v: k for k, v in self.layer_names.items()})
        object.__setattr__(self, "_to_hf_global", {v: k for k, v in self.global_names.items()})
        object.__setattr__(self, "_part_of", {part: (hf, i) for hf, f in self.fused.items()
                                              for i, part in enumerate(f.parts)})

    def _split(self, key: str, suffix: str, value: torch.Tensor, config: dict[str, Any] | None,
               where: str) -> dict[str, torch.Tensor]:
        """A fused HF tensor -> its torchtune parts (row views), checking the row counts."""
        if config is None:
            raise ValueError(f"{self.family} weights: splitting {key!r} needs config.json")
        rows = self.fused[suffix].rows(config)
        if sum(rows) != value.shape[0]:
            raise ValueError(f"{where}: {key!r} has {value.shape[0]} rows; config.json says "
                             f"{' + '.join(map(str, rows))}")
        return dict(zip(self.fused[suffix].parts, value.split(list(rows))))

    def hf_name(self, tune_key: str) -> str:
        """The HF name of the torchtune weight ``tune_key``.

        Raises:
            ValueError: it has none (a LoRA weight: merge adapters first).
        """
        match = _TUNE_LAYER.match(tune_key)
        if match and match.group(2) in self._to_hf_layer:
            return f"model.layers.{match.group(1)}.{self._to_hf_layer[match.group(2)]}"
        if tune_key in self._to_hf_global:
            return self._to_hf_global[tune_key]
        match = _TUNE_LAYER.match(tune_key)
        if match and match.group(2) in self._part_of:
            return f"model.layers.{match.group(1)}.{self._part_of[match.group(2)][0]}"
        raise ValueError(f"{self.family} weights: no HF name for the torchtune weight "
                         f"{tune_key!r}")

    def hf_to_tune(self, state_dict: dict[str, torch.Tensor], *, tie_word_embeddings: bool,
                   where: str = "the checkpoint", config: dict[str, Any] | None = None
                   ) -> dict[str, torch.Tensor]:
        """HF weights -> torchtune names (tensors unchanged; a :class:`Fused` one split into
        row views).

        Args:
            state_dict: HF name -> tensor (all shards merged).
            tie_word_embeddings: drop ``lm_head.weight`` (the output is the embedding table).
            where: how to name the source in messages.
            config: ``config.json`` (needed only to split fused tensors).

        Raises:
            ValueError: a weight the family does not have, naming it; a fused tensor whose
                rows do not add up to what ``config.json`` says.
        """
        out = {}
        for key, value in state_dict.items():
            if key.endswith("rotary_emb.inv_freq") or (tie_word_embeddings
                                                       and key == "lm_head.weight"):
                continue
            match = _HF_LAYER.match(key)
            if match and match.group(2) in self.layer_names:
                out[f"layers.{match.group(1)}.{self.layer_names[match.group(2)]}"] = value
            elif match and match.group(2) in self.fused:
                for part, tensor in self._split(key, match.group(2), value, config,
                                                where).items():
                    out[f"layers.{match.group(1)}.{part}"] = tensor
            elif key in self.global_names:
                out[self.global_names[key]] = value
            else:
                raise ValueError(f"{where}: weight {key!r} is not {self.not_part}; is "
                                 "config.json's architecture right?")
        return out

    def tune_to_hf(self, state_dict: dict[str, torch.Tensor],
                   pending: dict | None = None) -> dict[str, torch.Tensor]:
        """torchtune weights -> HF names (no LoRA keys); the parts of a :class:`Fused` tensor
        are stacked into it.

        Args:
            state_dict: torchtune name -> tensor, the whole model or a part of it.
            pending: where parts of a fused tensor wait for the others across calls (the vLLM
                weight sync converts one tensor at a time); ``None``: every part must be in
                ``state_dict``.

        Raises:
            ValueError: a weight without an HF name; with ``pending=None``, a fused tensor
                with parts missing.
        """
        waiting: dict = {} if pending is None else pending
        out = {}
        for key, value in state_dict.items():
            match = _TUNE_LAYER.match(key)
            if not (match and match.group(2) in self._part_of):
                out[self.hf_name(key)] = value
                continue
            hf_suffix, index = self._part_of[match.group(2)]
            name = f"model.layers.{match.group(1)}.{hf_suffix}"
            group = waiting.setdefault(name, {})
            group[index] = value
            if len(group) == len(self.fused[hf_suffix].parts):
                out[name] = torch.cat([group[i] for i in range(len(group))])
                del waiting[name]
        if pending is None and waiting:
            raise ValueError(f"{self.family} weights: parts of {sorted(waiting)[:2]} are "
                             "missing; the fused tensor needs all of them")
        return out

    def tune_to_peft_adapter(self, adapter: dict[str, torch.Tensor],
                             config: dict[str, Any] | None = None
                             ) -> dict[str, torch.Tensor] | None:
        """torchtune LoRA/DoRA adapter weights -> PEFT names for the HF base model.

        ``layers.{i}.attn.q_proj.proj.lora_a.weight`` ->
        ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (``lora_b`` ->
        ``lora_B``, ``magnitude`` -> ``lora_magnitude_vector``); a fused module's parts become
        one adapter (``config``: ``config.json``, needed only then).

        Returns:
            The PEFT tensors, or ``None`` where DoRA adapts only some parts of a fused module.
        """
        out = {}
        groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        for key, value in adapter.items():
            for tune_part, peft_part in _PEFT_PARTS:
                if key.endswith(tune_part):
                    tune_base = key[: -len(tune_part)] + ".weight"
                    base = self.hf_name(tune_base)[: -len(".weight")]
                    match = _TUNE_LAYER.match(tune_base)
                    if match and match.group(2) in self._part_of:
                        index = self._part_of[match.group(2)][1]
                        groups.setdefault(base, {}).setdefault(index, {})[peft_part] = value
                    else:
                        out["base_model.model." + base + peft_part] = value
                    break
            else:
                raise ValueError(f"{self.family} adapter: {key!r} is not a LoRA/DoRA weight")
        for base, parts in groups.items():
            fused = self._fused_adapter(base, parts, config)
            if fused is None:
                return None
            out.update({"base_model.model." + base + k: v for k, v in fused.items()})
        return out

    def _fused_adapter(self, base: str, parts: dict[int, dict[str, torch.Tensor]],
                       config: dict[str, Any] | None) -> dict[str, torch.Tensor] | None:
        """One fused module's PEFT adapter from its parts' (``None``: DoRA on some parts)."""
        fused = self.fused[base.split(".", 3)[3] + ".weight"]
        dora = any(".lora_magnitude_vector" in p for p in parts.values())
        if dora and len(parts) < len(fused.parts):
            return None
        if config is None:
            raise ValueError(f"{self.family} adapter: fusing {base!r} needs config.json")
        rows = fused.rows(config)
        order = sorted(parts)
        lora_a = torch.cat([parts[i][".lora_A.weight"] for i in order])
        lora_b = lora_a.new_zeros(sum(rows), lora_a.shape[0])
        col = 0
        for i in order:
            block = parts[i][".lora_B.weight"]
            row = sum(rows[:i])
            lora_b[row : row + rows[i], col : col + block.shape[1]] = block
            col += block.shape[1]
        out = {".lora_A.weight": lora_a, ".lora_B.weight": lora_b}
        if dora:
            out[".lora_magnitude_vector"] = torch.cat(
                [parts[i][".lora_magnitude_vector"] for i in order])
        return out

    def peft_adapter_config(self, adapter_config: dict[str, Any],
                            base_model_name_or_path: str | None) -> dict[str, Any]:
        """torchtune's adapter config -> PEFT's ``adapter_config.json``
        (``tune_to_peft_adapter_config``), the parts of a fused module named by it, with
        ``rank_pattern``/``alpha_pattern`` for its stacked rank."""
        from torchtune.models.convert_weights import tune_to_peft_adapter_config

        config = dict(adapter_config)
        targets = list(config["target_modules"])
        stacked = {}
        for hf_suffix, fused in self.fused.items():
            names = [part.rsplit(".", 2)[-2] for part in fused.parts]
            hit = [name for name in names if name in targets]
            if hit:
                targets = [t for t in targets if t not in names]
                stacked[_module(hf_suffix)] = len(hit)
        config["target_modules"] = targets
        out = tune_to_peft_adapter_config(adapter_config=config,
                                          base_model_name_or_path=base_model_name_or_path)
        out["target_modules"] = list(out["target_modules"]) + list(stacked)
        if stacked:
            r, alpha = out["r"], out["lora_alpha"]
            out["rank_pattern"] = {m: r * n for m, n in stacked.items()}
            out["alpha_pattern"] = {m: alpha * n for m, n in stacked.items()}
        return out


class HFFamilyCheckpointer:
    """Reads and writes a family's HF folder in torchtune names, with the files torchtune's
    ``FullModelHFCheckpointer`` writes.

    The recipes read torchtune's attributes ``_config``, ``_model_type``, ``_output_dir`` and
    ``_weight_map`` (HF name -> shard id such as ``"0001"``, set by :meth:`load_checkpoint`).

    Args:
        names: the family's :class:`WeightNames`.
        checkpoint_dir: the HF folder (``config.json`` and the weight files).
        checkpoint_files: weight file names in it (sharded ``*.safetensors`` or ``*.bin``).
        output_dir: where :meth:`save_checkpoint` writes ``epoch_{epoch}/``.
        model_type: the family's (``names.model_type``; another is an error).
        safe_serialization: write ``*.safetensors`` (else ``*.bin``).
        **unsupported: torchtune's resume arguments, accepted only as false/None.
    """

    def __init__(self, names: WeightNames, checkpoint_dir: str, checkpoint_files: list[str],
                 output_dir: str, model_type: str | None = None,
                 safe_serialization: bool = True, **unsupported: Any) -> None:
        from torchtune.training.checkpointing._utils import check_outdir_not_in_ckptdir

        self.names = names
        if model_type is not None and str(model_type).upper() != names.model_type:
            raise ValueError(f"{names.family} checkpointer: model_type {model_type!r}; only "
                             f"{names.model_type}")
        given = sorted(k for k, v in unsupported.items() if v)
        if given:
            raise ValueError(f"checkpointer: {given} not supported for {names.family} folders "
                             "(resume with resume_from_checkpoint at the top level of the "
                             "config)")
        self._checkpoint_dir = Path(checkpoint_dir)
        self._checkpoint_files = list(checkpoint_files)
        self._output_dir = Path(output_dir)
        check_outdir_not_in_ckptdir(ckpt_dir=self._checkpoint_dir, out_dir=self._output_dir)
        self._output_dir.mkdir(parents=True, exist_ok=True)
        self._safe_serialization = safe_serialization
        self._model_type = FamilyModelType[names.model_type]
        self._config: dict[str, Any] = json.loads((self._checkpoint_dir / "config.json")
                                                  .read_text())
        self._weight_map: dict[str, str] | None = None
        repo = self._checkpoint_dir / "original_repo_id.json"
        self.repo_id = json.loads(repo.read_text()).get("repo_id") if repo.is_file() else None

    @property
    def _tied(self) -> bool:
        return bool(self._config.get("tie_word_embeddings", self.names.tied_by_default))

    def load_checkpoint(self) -> dict[str, Any]:
        """``{"model": torchtune-named weights}`` from every checkpoint file, shards merged."""
        from torchtune import training
        from torchtune.training.checkpointing._utils import safe_torch_load

        merged: dict[str, torch.Tensor] = {}
        self._weight_map = {}
        for index, name in enumerate(sorted(self._checkpoint_files)):
            path = self._checkpoint_dir / name
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint file {path} not found")
            for key, value in safe_torch_load(path).items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"{path}: {key!r} is not a tensor")
                self._weight_map[key] = f"{index + 1:04}"
                merged[key] = value
        model = self.names.hf_to_tune(merged, tie_word_embeddings=self._tied,
                                      where=str(self._checkpoint_dir), config=self._config)
        return {training.MODEL_KEY: model}

    def _write(self, tensors: dict[str, torch.Tensor], path: Path) -> Path:
        from safetensors.torch import save_file

        if self._safe_serialization:
            path = path.with_suffix(".safetensors")
            save_file(tensors, str(path), metadata={"format": "pt"})
        else:
            path = path.with_suffix(".bin")
            torch.save(tensors, path)
        return path

    def _save_model(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        """HF-named shards as the input was split, and their index file."""
        from torchtune.training.checkpointing._utils import (
            SAFETENSOR_INDEX_FNAME,
            SHARD_FNAME,
            TORCH_INDEX_FNAME,
        )

        hf = self.names.tune_to_hf(weights)
        shard_of = self._weight_map or {key: "0001" for key in hf}
        missing = sorted(set(hf) - set(shard_of))
        if missing:
            raise ValueError(f"{self.names.family} checkpointer: {missing[:3]} were not in the "
                             "loaded checkpoint; the model does not match its config.json")
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in hf.items():
            shards.setdefault(shard_of[key], {})[key] = value
        total = sum(v.numel() * v.element_size() for v in hf.values())
        index: dict[str, str] = {}
        for number, shard in enumerate(sorted(shards), start=1):
            name = SHARD_FNAME.format(cpt_idx=f"{number}".zfill(5),
                                      num_shards=f"{len(shards)}".zfill(5))
            written = self._write(shards[shard], folder / name)
            index.update({key: written.name for key in shards[shard]})
        index_name = SAFETENSOR_INDEX_FNAME if self._safe_serialization else TORCH_INDEX_FNAME
        (folder / index_name).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": index}, indent=2))

    def save_checkpoint(self, state_dict: dict[str, Any], epoch: int,
                        intermediate_checkpoint: bool = False, adapter_only: bool = False
                        ) -> None:
        """Write ``output_dir/epoch_{epoch}/`` as ``FullModelHFCheckpointer`` does.

        Args:
            state_dict: ``"model"`` (torchtune names), and for LoRA ``"adapter"`` and
                ``"adapter_config"``; other keys are recipe state.
            epoch: the folder's number.
            intermediate_checkpoint: also write the remaining keys to
                ``output_dir/recipe_state/recipe_state.pt``.
            adapter_only: write the adapter files only.

        Raises:
            ValueError: ``adapter_only`` without adapter weights.
        """
        from torchtune import training
        from torchtune.training.checkpointing._utils import (
            ADAPTER_CONFIG_FNAME,
            ADAPTER_MODEL_FNAME,
            RECIPE_STATE_DIRNAME,
            SUFFIXES_TO_NOT_COPY,
            copy_files,
        )

        folder = self._output_dir / f"epoch_{epoch}"
        folder.mkdir(parents=True, exist_ok=True)
        if not adapter_only:
            self._save_model(state_dict[training.MODEL_KEY], folder)
        peft = None
        if training.ADAPTER_KEY in state_dict:
            adapter = state_dict[training.ADAPTER_KEY]
            torch.save(adapter, (folder / ADAPTER_MODEL_FNAME).with_suffix(".pt"))
            peft = self.names.tune_to_peft_adapter(adapter, self._config)
            if peft is not None:
                self._write(peft, folder / ADAPTER_MODEL_FNAME)
        elif adapter_only:
            raise ValueError("adapter_only: the state dict holds no adapter weights")
        if training.ADAPTER_CONFIG in state_dict and (peft is not None
                                                      or training.ADAPTER_KEY not in state_dict):
            config = self.names.peft_adapter_config(
                dict(state_dict[training.ADAPTER_CONFIG]), self.repo_id)
            (folder / f"{ADAPTER_CONFIG_FNAME}.json").write_text(json.dumps(config))
        copy_files(self._checkpoint_dir, folder, ignore_suffixes=SUFFIXES_TO_NOT_COPY)
        if intermediate_checkpoint:
            rest = {k: v for k, v in state_dict.items() if k not in (
                training.MODEL_KEY, training.ADAPTER_KEY, training.ADAPTER_CONFIG)}
            path = self._output_dir / RECIPE_STATE_DIRNAME / "recipe_state.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(rest, path)


#: torchtune's Qwen2 names (``qwen2``/``qwen2_5`` builders, QKV biases) and their HF names.
QWEN2_NAMES = WeightNames(
    family="Qwen2", model_type="QWEN2",
    global_names={"model.embed_tokens.weight": "tok_embeddings.weight",
                  "model.norm.weight": "norm.scale", "lm_head.weight": "output.weight"},
    layer_names={**{f"self_attn.{hf}.{p}": f"attn.{tt}.{p}" for hf, tt in (
        ("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"))
        for p in ("weight", "bias")},
        "self_attn.o_proj.weight": "attn.output_proj.weight",
        "mlp.gate_proj.weight": "mlp.w1.weight", "mlp.down_proj.weight": "mlp.w2.weight",
        "mlp.up_proj.weight": "mlp.w3.weight", "input_layernorm.weight": "sa_norm.scale",
        "post_attention_layernorm.weight": "mlp_norm.scale"},
    tied_by_default=False, not_part="part of a Qwen2ForCausalLM")


def qwen2_checkpointer(**kwargs: Any) -> Any:
    """torchtune's ``FullModelHFCheckpointer`` for ``model_type: QWEN2``, PEFT adapter fixed.

    After torchtune's save, ``adapter_model.safetensors`` is written again from the adapter
    weights with :data:`QWEN2_NAMES` (renaming only, no Llama q/k row permutation).
    """
    from torchtune import training
    from torchtune.training import FullModelHFCheckpointer

    class Qwen2HFCheckpointer(FullModelHFCheckpointer):
        def save_checkpoint(self, state_dict: dict[str, Any], epoch: int,
                            intermediate_checkpoint: bool = False,
                            adapter_only: bool = False) -> None:
            adapter = dict(state_dict.get(training.ADAPTER_KEY) or {})  # torchtune renames it
            super().save_checkpoint(state_dict, epoch, intermediate_checkpoint, adapter_only)
            path = Path(self._output_dir) / f"epoch_{epoch}" / "adapter_model.safetensors"
            if adapter and self._safe_serialization and path.is_file():
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in
                           QWEN2_NAMES.tune_to_peft_adapter(adapter).items()}, str(path),
                          metadata={"format": "pt"})

    return Qwen2HFCheckpointer(**kwargs)
